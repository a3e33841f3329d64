"""Every train result records the step-time model's prediction and its error against the measurement."""
from __future__ import annotations

import json
import math

from scaletool import api
from scaletool.config import load_recipe
from scaletool.predict.prediction import CPU_NOTE, cpu_calibration, predict

FAST = ["train.steps=5", "train.measure_warmup_steps=1", "train.log_every=1"]


def test_a_cpu_run_records_the_prediction_and_its_error(tmp_path):
    s = api.train("tiny", overrides=FAST, out=tmp_path / "run", quiet=True)
    m = s.metrics
    assert s.status == "completed" and s.tokens_per_s > 0
    assert m["predict/step_s"] > 0 and m["predict/tokens_per_s"] > 0 and m["predict/tokens_per_s_per_gpu"] > 0
    assert math.isclose(m["predict/rel_error_tokens_per_s"], m["predict/tokens_per_s"] / s.tokens_per_s - 1)
    # the prediction is the model's for this recipe on the CPU placeholder calibration, and says it means nothing
    expected = predict(load_recipe("tiny", FAST), cpu_calibration(), 1)
    assert math.isclose(m["predict/tokens_per_s"], expected["tokens_per_s"])
    p = s.prediction
    assert p["meaningful"] is False and p["calibration_source"] == CPU_NOTE and p["bound"] and p["terms"]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["metrics"]["predict/tokens_per_s"] == m["predict/tokens_per_s"]
    assert on_disk["prediction"]["rel_error_tokens_per_s"] == m["predict/rel_error_tokens_per_s"]
