"""``scaletool launch``: what a launch would run (a dry run), or how it ended on this node."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from scaletool.results.base import Result, register


@register
class LaunchResult(Result):
    """Fields a launcher or mode does not produce stay null."""

    kind: Literal["launch"] = "launch"
    launcher: Literal["torchrun", "deepspeed", "slurm"]
    dry_run: bool
    argv: list[str] | None = Field(None, description="the node's command (torchrun, deepspeed), one argument each")
    env: dict[str, str] | None = Field(None, description="dry run: environment the node's command needs")
    hostfile: str | None = Field(None, description="deepspeed: the hostfile it reads")
    hostfile_text: str | None = Field(None, description="deepspeed --hosts: the hostfile written before it runs")
    script: str | None = Field(None, description="slurm dry run: the sbatch script")
    script_path: str | None = Field(None, description="slurm: where the script is (or would be) written")
    job_id: str | None = Field(None, description="slurm --submit: sbatch's job id")
    exit_code: int | None = Field(None, description="after a run: this node's exit status")
    errors: list[str] = Field([], description="after a run: one `error:` line per failed rank, root cause first")
    out_dir: str | None = None
    summary: dict[str, Any] | None = Field(None, description="rank 0's summary.json when this node has it")
