"""ModelExecutePlan: how a call groups layers into stages (docs/trace.md, "2. Execution plans")."""
from typing import Any, Iterable, List, Optional, Union


class ModelExecutePlan:
    """``fwd_plan`` and ``bwd_plan`` are lists of ``range`` objects over layer
    indices. Forward ranges are ascending and contiguous from layer 0; backward
    ranges are listed deepest first and cover every layer once. For
    ``forward_backward`` the forward plan ends where the first (fused)
    backward stage begins. A call validates the plan against its model and
    raises ValueError naming the broken rule."""

    def __init__(self, fwd_plan: Optional[Iterable[range]] = None, bwd_plan: Optional[Iterable[range]] = None) -> None:
        self.fwd_plan = list(fwd_plan or [])
        self.bwd_plan = list(bwd_plan or [])
        for name, plan in (("fwd_plan", self.fwd_plan), ("bwd_plan", self.bwd_plan)):
            for r in plan:
                if not isinstance(r, range):
                    raise TypeError(f"ModelExecutePlan.{name}: entries must be range objects, got {r!r}")

    @staticmethod
    def auto(run_type: str, *models: Any, min_stages: Optional[int] = None, upper_threshold: float = 1.1,
             model_memory_limit: Optional[float] = None) -> Union["ModelExecutePlan", List["ModelExecutePlan"]]:
        """Plans for ``models`` (RoundPipe models called one after another),
        planned jointly: stages of balanced time, the fewest stages whose
        bottleneck stays within ``upper_threshold`` of the best reachable, at
        least ``min_stages`` per pass (default: the number of devices), and
        each stage's parameters and gradients within half of
        ``model_memory_limit`` (GB; default: 60% of the smallest accelerator's
        memory, unlimited on CPU devices). Layer times are the models' timer
        estimates (``roundpipe.timer``); before a model has them, its
        parameter sizes stand in. ``run_type`` is "infer", "train" or
        "fused"; for "fused" only the last model gets a fused plan (it runs
        forward_backward), the ones chained before it train plans. Returns
        one plan for one model, else a list. The exact rules:
        include/roundpipe/auto_plan.h."""
        from . import _C
        from ._engines import engines_of
        engines = engines_of(models, "ModelExecutePlan.auto")
        if min_stages is None:
            min_stages = engines[0].num_devices()
        if model_memory_limit is None:
            limit = _default_memory_limit_bytes()
        elif model_memory_limit <= 0:
            raise ValueError(f"ModelExecutePlan.auto: model_memory_limit must be > 0 GB, got {model_memory_limit}")
        else:
            limit = int(model_memory_limit * 2 ** 30)
        plans = _C.auto_execute_plans(run_type, engines, int(min_stages), float(upper_threshold), limit)
        return plans[0] if len(plans) == 1 else plans

    def __eq__(self, other):
        return (isinstance(other, ModelExecutePlan) and self.fwd_plan == other.fwd_plan
                and self.bwd_plan == other.bwd_plan)

    def __repr__(self):
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan!r}, bwd_plan={self.bwd_plan!r})"


def _default_memory_limit_bytes():
    """60% of the smallest accelerator's memory; 0 (unlimited) on CPU devices."""
    import torch
    from . import _C
    sizes = []
    for name in _C.get_device_names():
        if name.startswith("cuda") and torch.cuda.is_available():
            sizes.append(torch.cuda.get_device_properties(int(name.split(":")[1])).total_memory)
    return int(0.6 * min(sizes)) if sizes else 0
