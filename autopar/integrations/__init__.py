"""autopar inside the training loops people already own.

- ``autopar.integrations.transformers.AutoparTrainer``: the Hugging Face ``Trainer`` with
  the model run by ``autopar.parallelize`` (one added line in a Trainer script).

Each integration imports its framework only when it is imported itself, so ``import
autopar`` never needs them.
"""
