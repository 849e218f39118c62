"""Multi-node tests drive their own simulated cluster (``splitserve.sim_cluster``) and a ``splitserve
serve`` process joined to it; they share the serving tests' checkpoint."""

from tests.serving.conftest import serving_model  # noqa: F401  (a fixture)
