"""Planning: which layout to run on N GPUs, predicted before any of it runs.

:mod:`.space` enumerates the layouts and fits them to the card with the phase-resolved memory
estimate, :mod:`.search` predicts and ranks them with the step-time model, :mod:`.commands` writes
each as a ready-to-run ``scaletool launch`` command, and :mod:`.verify` runs the best that fit this
machine for a few steps and sets the measurement beside the prediction.
"""
