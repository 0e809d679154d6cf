"""quantscope's observers inside other toolkits' pipelines, one module per toolkit.

=========================  ==================================================================
module                     what importing it does
=========================  ==================================================================
``llmcompressor``          registers every quantscope observer in llm-compressor's ``Observer``
                           registry as ``quantscope_<name>`` (``observer: quantscope_histogram``)
``torchao``                nothing to register: the :mod:`quantscope.compat.torch_ao` classes
                           are torch.ao observers; it holds the QConfig / pt2e
                           ``QuantizationSpec`` helpers
``quark``                  Quark observer classes for ``QuantizationSpec(observer_cls=...)``
=========================  ==================================================================

Each module imports its toolkit at the top: importing it without the toolkit installed is a
``ModuleNotFoundError`` naming the toolkit.
"""
