"""Kinds as data, torch-free: attention kinds and position encodings (:mod:`.attention`) and training
engines (:mod:`.engines`). The recipe schema builds its choices and checks from these registries,
the analytic layer takes their closed forms, and the torch side finds its parts by their names."""
