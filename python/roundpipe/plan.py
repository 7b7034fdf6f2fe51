"""ModelExecutePlan: how a call groups layers into stages (SPEC 6)."""


class ModelExecutePlan:
    """``fwd_plan`` and ``bwd_plan`` are lists of ``range`` objects over layer
    indices. Forward ranges are ascending and contiguous from layer 0; backward
    ranges are listed deepest first and cover every layer once. For
    ``forward_backward`` the forward plan ends where the first (fused)
    backward stage begins. A call validates the plan against its model and
    raises ValueError naming the broken rule."""

    def __init__(self, fwd_plan=None, bwd_plan=None):
        self.fwd_plan = list(fwd_plan or [])
        self.bwd_plan = list(bwd_plan or [])
        for name, plan in (("fwd_plan", self.fwd_plan), ("bwd_plan", self.bwd_plan)):
            for r in plan:
                if not isinstance(r, range):
                    raise TypeError(f"ModelExecutePlan.{name}: entries must be range objects, got {r!r}")

    @staticmethod
    def auto(run_type, *models, min_stages=None, upper_threshold=1.1, model_memory_limit=None):
        """Plans for ``models`` (RoundPipe models called one after another),
        planned jointly: stages of balanced cost, the fewest stages whose
        bottleneck stays within ``upper_threshold`` of the best reachable, at
        least ``min_stages`` per pass (default: the number of devices), and
        each stage's parameters and gradients within half of
        ``model_memory_limit`` (GB; default: unlimited on CPU devices). Layer
        costs are estimated from parameter sizes. Returns one plan for one
        model, else a list. The exact rules: include/roundpipe/auto_plan.h."""
        from . import _C
        if not models:
            raise ValueError("ModelExecutePlan.auto: give at least one model")
        if min_stages is None:
            min_stages = _C.get_num_devices()
        limit = 0 if model_memory_limit is None else int(model_memory_limit * 2 ** 30)
        sizes = []
        for model in models:
            layers = getattr(model, "_layers", None)
            if layers is None:
                raise TypeError(f"ModelExecutePlan.auto: expected RoundPipe models, got {type(model).__name__}")
            sizes.append([sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers])
        plans = _C.auto_plan_from_sizes(run_type, sizes, int(min_stages), float(upper_threshold), limit)
        return plans[0] if len(plans) == 1 else plans

    def __eq__(self, other):
        return (isinstance(other, ModelExecutePlan) and self.fwd_plan == other.fwd_plan
                and self.bwd_plan == other.bwd_plan)

    def __repr__(self):
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan!r}, bwd_plan={self.bwd_plan!r})"
