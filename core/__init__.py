"""The bottom layer both processes share: errors, process identity and secrets (``procs``), the services file
(addresses and secrets, ``services_file``), one ``redis-server`` (``redis_server``) and the node-local cache
server (``local_redis``). It imports nothing from the rest of the package; everything else may import it.
"""
