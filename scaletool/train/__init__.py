"""Training: the trainer and its parts. Entry point: :class:`scaletool.train.trainer.Trainer`
(``scaletool.api.train`` runs it in one process, as a rank of a launcher, or over local ranks).

- :mod:`.trainer`: the Trainer (``train()`` reads top to bottom), signals, the failure type;
- :mod:`.callbacks`: the callback protocol and what callbacks see;
- :mod:`.resume`: where a run starts (fresh, from a checkpoint, or finished);
- :mod:`.checkpoint`: atomic, verified checkpoints and weight loading for other tools;
- :mod:`.clock`: per-step times and the measured window; :mod:`.summary`: the typed result;
- :mod:`.data`, :mod:`.schedule`, :mod:`.moe`, :mod:`.progress`: data, learning rate, MoE hooks, progress.
"""
