"""The result of a calibration and its uses: the Calibration object and per-role state, saving and
loading it, applying it to a model (QDQ), and reports and plots.
"""
