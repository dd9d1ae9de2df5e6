"""The configurations ``bench memory`` measures: a stage and where state is offloaded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroshard.planner.estimate import Choice


@dataclass(frozen=True)
class MemConfig:
    stage: int
    offload_optimizer: Optional[str] = None
    offload_params: Optional[str] = None

    def __post_init__(self) -> None:
        self.choice  # the planner's rules, which raise with the fix  # noqa: B018

    @property
    def choice(self) -> Choice:
        return Choice(self.stage, self.offload_optimizer, self.offload_params)

    @property
    def label(self) -> str:
        return self.choice.label

    def optimizer_kwargs(self, nvme_path: str) -> dict:
        """``ZeroOptimizer`` arguments (stage and offloads), with ``nvme_path`` where needed."""
        kw = self.choice.zero_kwargs()
        if self.choice.placement.state_swapped or self.choice.placement.params_swapped:
            kw["nvme_path"] = nvme_path
        return kw

    @classmethod
    def parse(cls, text: str) -> "MemConfig":
        """``"2"``, ``"2+cpu"`` (optimizer offload), ``"3+nvme+cpu"`` (optimizer to NVMe,
        parameters to CPU)."""
        parts = text.strip().split("+")
        try:
            if len(parts) > 3:
                raise ValueError("too many '+' parts")
            return cls(int(parts[0]), *(p or None for p in parts[1:]))
        except ValueError as exc:
            raise ValueError(f"configuration {text!r}: {exc}; write STAGE[+OPTIMIZER_OFFLOAD[+PARAMS_OFFLOAD]], "
                             "e.g. '2', '2+cpu' or '3+nvme+cpu'") from None


DEFAULT_CONFIGS = "0,1,2,3,2+cpu,2+nvme,3+cpu+cpu,3+nvme+cpu,3+nvme+nvme"
