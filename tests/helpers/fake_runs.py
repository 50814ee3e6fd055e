"""Finished runs written by hand (summary.json, steps.jsonl, config.toml), so that every number
the report and the recipe selection read is known and no worker is started."""
from __future__ import annotations

import json
from pathlib import Path

CONFIG = """strategy = "{strategy}"
workers = {workers}
steps = {steps}
micro_batch = 4
accum = 1

[model]
preset = "tiny"
n_layer = 2
d_model = 64
seq_len = 32

[data]
source = "{data}"

[link]
bandwidth = "100mbit"
latency = "10ms"
"""


def fake_run(root: Path, strategy: str, points: list[tuple[float, int, float]], *, params: int = 120_000,
             steps: int = 0, workers: int = 2, data: str = "shakespeare", state_mb: float = 1.0,
             extra_tokens: int = 0, load: float | None = None, cores: int = 2, options: dict | None = None,
             name: str = "") -> Path:
    """A finished run whose validation points are (seconds, bytes, loss), one step each
    (`steps`: what its config planned, if not that; `load`: the load average at its end, on
    `cores`, where it recorded one; `name`: its directory, if not the strategy's)."""
    steps = steps or len(points)
    run = root / (name or strategy)
    run.mkdir(parents=True, exist_ok=True)
    per_step = workers * 4 * 32
    steps_log, t, sent = [], 0.0, 0
    for i, (time_s, nbytes, loss) in enumerate(points, 1):
        steps_log.append({"step": i, "wall_s": time_s - t, "tokens": per_step + (extra_tokens if i == 1 else 0),
                          "wire_bytes": nbytes - sent, "compute_s": 0.1, "exposed_comm_s": 0.0, "val_loss": loss})
        t, sent = time_s, nbytes
    (run / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps_log))
    (run / "config.toml").write_text(CONFIG.format(strategy=strategy, workers=workers, steps=steps, data=data))
    tokens = sum(r["tokens"] for r in steps_log)
    (run / "summary.json").write_text(json.dumps({
        "strategy": strategy, "workers": workers, "steps": steps, "tokens": tokens, "params": params,
        "final_val_loss": points[-1][2], "wall_s": t, "tokens_per_s": tokens / t,
        "wire_bytes_per_rank_per_step": sent / workers / steps, "exposed_comm_fraction": 0.1,
        "optimizer_state_bytes_per_rank": state_mb * 1e6, "peak_mem_bytes": 2**28,
        "compute_s_per_rank": [t / 2] * workers, "exposed_comm_s_per_rank": [0.1] * workers,
        "slowdown": [1.0] * workers, "strategy_options": options or {},
        **({"machine": {"cores": cores, "threads": workers, "load_at_end": load}} if load is not None else {})}))
    return run
