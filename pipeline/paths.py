"""Where each stage's output lives, derived from the config in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Layout:
    artifacts: Path
    data: Path
    model_name: str
    heads_name: str
    task: str
    profile: str

    @classmethod
    def from_cfg(cls, cfg: Any) -> Layout:
        return cls(Path(cfg.artifacts_dir), Path(cfg.data_dir), cfg.model.name, cfg.heads.name, cfg.task.name, cfg.profile.name)

    def heads_dir(self, heads_name: str | None = None) -> Path:
        return self.artifacts / "heads" / self.model_name / (heads_name or self.heads_name)

    @property
    def work(self) -> Path:
        """Intermediate outputs of rollout / grow / recalibrate / time for this task and profile."""
        return self.artifacts / "rollouts" / self.model_name / self.heads_name / self.task / self.profile

    @property
    def bank_dir(self) -> Path:
        return self.artifacts / "banks" / self.model_name / self.heads_name / self.task

    @property
    def reports(self) -> Path:
        return self.artifacts / "reports" / self.model_name / self.heads_name / self.task
