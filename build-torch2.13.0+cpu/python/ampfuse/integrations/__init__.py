"""Adapters that put ampfuse inside the frameworks people train with.

Each submodule imports its framework when it is imported itself, never before (``import ampfuse``
and ``import ampfuse.integrations`` import no framework); a missing framework is an ``ImportError``
that names the pip package to install:

- :mod:`ampfuse.integrations.lightning`: ``MixedPrecision``, a precision plugin for the Lightning
  ``Trainer`` (``pip install 'ampfuse[lightning]'``).
- :mod:`ampfuse.integrations.fabric`: ``MixedPrecision``, the same for Lightning Fabric
  (``pip install 'ampfuse[lightning]'``).
- :mod:`ampfuse.integrations.accelerate`: ``enable(accelerator)`` for Hugging Face Accelerate
  (``pip install 'ampfuse[accelerate]'``).
- :mod:`ampfuse.integrations.transformers`: ``enable(trainer)`` for the transformers ``Trainer``
  (``pip install 'ampfuse[transformers]'``).
"""

__all__ = ["accelerate", "fabric", "lightning", "transformers"]
