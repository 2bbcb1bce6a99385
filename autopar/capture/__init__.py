"""Capture: a model plus its loss as one torch.fx graph of ATen ops with shapes.

``export`` runs torch.export (non-strict; symbolic_trace as the fallback); ``hops`` inlines
the higher-order ops export emits for grad-mode and autocast-off regions and names any
other; ``inplace`` and ``constants`` normalise what Hugging Face models write in forward;
``graph`` is the result every later step reads (``Captured``).
"""
from autopar.capture.graph import Captured, CaptureError, fingerprint, layer_of
from autopar.capture.export import capture

__all__ = ["Captured", "CaptureError", "capture", "fingerprint", "layer_of"]
