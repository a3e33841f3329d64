"""Predicting a run before it runs, and checking the prediction after: the step-time model's lookups per card
(:mod:`.prediction`), measuring a card's rates into a calibration (:mod:`.calibrate`, :mod:`.calibrate_comm`), and
re-predicting recorded runs and other projects' published ones (:mod:`.validation`, :mod:`.published`)."""
