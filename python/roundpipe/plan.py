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

    def __eq__(self, other):
        return (isinstance(other, ModelExecutePlan) and self.fwd_plan == other.fwd_plan
                and self.bwd_plan == other.bwd_plan)

    def __repr__(self):
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan!r}, bwd_plan={self.bwd_plan!r})"
