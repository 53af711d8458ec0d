"""The backend contract, by concern; ``backends.base`` is its face, from which everything is imported.

- ``memory``: host and device buffers, their byte ranges, the row gathers of ``Stream.gather_h2d``;
- ``streams``: streams, events, kernels and captured graphs;
- ``devices``: devices, their capabilities, and the backend that holds them;
- ``host``: ``Backend.host``, the host's clock and memcpy as the backend stands for them.
"""
