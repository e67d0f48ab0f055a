"""Adapters that plug kvtier into existing inference engines.

Each adapter lives in its own module and imports its engine lazily, so importing
``kvtier.integrations`` never requires any engine to be installed:

- :mod:`kvtier.integrations.transformers` -- the continuous-batching engine of Hugging Face
  ``transformers`` (``generate_batch`` / ``ContinuousBatchingManager``); install with
  ``pip install "kvtier[hf]"``.
"""

__all__: list[str] = []
