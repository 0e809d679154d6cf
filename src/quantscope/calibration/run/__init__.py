"""The calibration pass and what feeds it: the session that runs the model over the batches, the
hooks that observe each layer, the sample and batch handling, data-parallel gathering, the
memory heap, sequential (block by block) calibration, and loading checkpoints to calibrate.
"""
