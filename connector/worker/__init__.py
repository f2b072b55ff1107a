"""The worker process's half: host slot pools, copies between device and host, storage I/O.

It executes ``connector.protocol`` plans and never decides anything itself.
"""
