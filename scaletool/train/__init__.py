"""Training: the loop, its data, schedule and checkpoints. Entry point: :func:`scaletool.train.loop.run`."""
