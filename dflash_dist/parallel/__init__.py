"""Ranks and wires: the distributed context and its groups (dist.py), roles and routes as pure functions
(topology.py), point-to-point feature packets (transport.py), drafter gradients under DDP or FSDP2
(sharding.py), and the stop flag with its in-band agreement (stop.py). (The heartbeats and the dead-peer
watchdog are runtime/liveness.py, on the ground floor: regeneration, in data/, uses them too.)

May import: data/ (the packed batch a packet carries), models/, observe/, runtime/, io/, config.py,
exits.py.
"""
