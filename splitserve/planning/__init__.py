"""Capacity planning: profiles of a model's steps on a device (``profile``, ``measure``), a discrete-event
simulation of a deployment timed by them (``simulator``, ``sim_workers``), and the command lines
(``options``). docs/planning.md."""
