"""Training through other libraries' loops with roundpipe underneath.

- ``roundpipe.integrations.transformers``: Hugging Face ``Trainer`` and TRL's
  ``SFTTrainer`` (``RoundPipeTrainer``, ``RoundPipeSFTTrainer``,
  ``RoundPipeTrainerMixin``).

Each submodule imports its library when it is imported itself, so ``import
roundpipe`` never needs them.
"""
