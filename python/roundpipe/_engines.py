"""The engines behind RoundPipe models, for the functions that take several
models (timings, automatic plans)."""


def engines_of(models, who):
    """The engines of RoundPipe ``models`` (at least one), for ``who``'s errors."""
    if not models:
        raise ValueError(f"{who}: give at least one model")
    engines = []
    for model in models:
        engine = getattr(model, "_engine", None)
        if engine is None:
            raise TypeError(f"{who}: expected RoundPipe models, got {type(model).__name__}")
        engines.append(engine)
    return engines
