"""The deployment: ``splitserve serve`` and its parts (docs/cluster.md).

``deployment`` (``Deployment``: the parts below, put together), ``ray_runtime`` (starting or joining Ray),
``router_host`` (the router's event loop beside the driver), ``placement`` (placement groups and the
tensor-parallel bundles), ``fleet`` (the worker actors: spawn, wait, stop), ``scaler`` (scaling a role,
the live planner's hands), ``actors`` and ``rank_actors`` (the Ray actors a worker and its other ranks
run in), ``config`` (the deployment file), ``roles`` (which worker class serves each role),
``embedded_ray``, ``processes``, ``sim_cluster`` (a multi-node Ray cluster on one machine),
``live_planner`` with ``planner_settings`` and the step ``profile`` format it reads, and ``ray_adapter``,
the one module that touches Ray's private API."""
