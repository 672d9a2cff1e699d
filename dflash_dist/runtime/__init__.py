"""What every rank of a job runs beside its work, whichever job it is (training, regeneration): the
heartbeats in torchrun's rendezvous store and the dead-peer watchdog that ends a rank whose peer went
silent or failed (liveness.py). A ground floor, below data/ and parallel/, because regeneration's ranks
share no process group, only the store, and watch each other with it too.

May import: exits.py.
"""
