"""quantscope's observers inside other toolkits' pipelines, one module per toolkit.

=========================  ==================================================================
module                     what importing it does
=========================  ==================================================================
``llmcompressor``          registers every quantscope observer in llm-compressor's ``Observer``
                           registry as ``quantscope_<name>`` (``observer: quantscope_histogram``)
``torchao``                registers :class:`~quantscope.compat.torch_ao.TorchAOObserver` (the
                           base of the :mod:`quantscope.compat.torch_ao` classes) as a virtual
                           subclass of torchao's pt2e ``ObserverBase``, which ``prepare_pt2e``
                           / ``convert_pt2e`` test with ``isinstance``; it re-exports those
                           classes for a ``QuantizationSpec``'s ``observer_or_fake_quant_ctr``
=========================  ==================================================================

No Quark module: Quark 0.13's ``QTensorConfig`` accepts only the classes in its observer sets,
and the Quark-signature classes of :mod:`quantscope.compat.quark` join those sets themselves
(``register_with_quark``, run whichever of the two is imported first), so there is nothing
more to plug in.

Each module imports its toolkit at the top: importing it without the toolkit installed is a
``ModuleNotFoundError`` naming the toolkit.
"""
