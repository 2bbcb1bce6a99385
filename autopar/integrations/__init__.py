"""autopar inside the training loops people already own.

- ``autopar.integrations.transformers.AutoparTrainer``: the Hugging Face ``Trainer`` with
  the model run by ``autopar.parallelize`` (one added line in a Trainer script).
- ``autopar.integrations.torchtitan.model_spec``: torchtitan's own trainer, data and Llama 3
  with autopar as the model's ``parallelize_fn``.

Each integration imports its framework only when it is imported itself, so ``import
autopar`` never needs them.
"""
