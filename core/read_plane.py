"""Open reads: the cache's sealed entries read over a plaintext port, with no secret sent.

A deployment with client TLS (``bagua-lightning up``, compose, the Kubernetes manifests) gives every Redis
node a second client port, its *read port*: plaintext, where a client logs in as :data:`READER_USER`, a user
without a password that may only ``GET``/``MGET`` keys under :data:`SEALED_KEY_PREFIX` and ``PING``. Only
sealed cache entries live there: a sealing loader stores its entries under that prefix
(:mod:`bagua_lightning.client.cache.loader`), and ``RedisStore`` refuses to write anything but a sealed entry
under it. So a value written in clear (``RedisStore.set("cfg", ...)``, an unkeyed cache, the autotune
service's plans) is never readable without the password. A trainer with the cache key reads its samples there:

* nothing secret crosses that connection (the user name is public; there is no password), so a process that
  squats a dead node's read port learns nothing it could use;
* what it reads is sealed: AES-256-GCM ciphertext under a key derived from the cache key, bound to the Redis
  key it is stored under (:mod:`bagua_lightning.client.cache.digests`). A forged or swapped reply fails its tag
  and is a miss; an eavesdropper sees key names, lengths and ciphertext;
* the slot map still comes from the TLS port (a node that proved it is the deployment's), and writes,
  administration and replication stay there, with the password.

Why not TLS for reads too: Python's TLS record layer decrypts one 16 KB record per call, which bounds a
reader at about 0.6x of plaintext; a sealed entry is decrypted in one call at the cipher's speed, where it
lies in the receive buffer (0.92x the plaintext reads of a keyed deployment, docs/benchmarks.md, "Open
reads"). docs/deployment.md ("Open reads") argues the trade.

The read port of a node is its client port plus the deployment's *read port offset*, recorded in the
services file (``redis.read_port_offset``) or given by :data:`READ_PORT_OFFSET_ENV`.
"""

from __future__ import annotations

READER_USER = "bagua-reader"  # the ACL user of the read ports; it has no password (``nopass``)
READ_PORT_OFFSET_ENV = "BAGUA_LIGHTNING_REDIS_READ_PORT_OFFSET"
# The keys of sealed entries, and the only keys the reader may read. "!" starts no key of an entry in clear: a
# dataset name is percent-encoded (client/cache/keys.py), "!" becoming "%21".
SEALED_KEY_PREFIX = "!sealed:"
READER_COMMANDS = ("get", "mget", "ping")


def reader_acl_rules() -> list[str]:
    """The ACL rules of :data:`READER_USER` (after its name in a ``user`` line or ``ACL SETUSER``)."""
    return ["reset", "on", "nopass", f"%R~{SEALED_KEY_PREFIX}*", "resetchannels", "-@all",
            *(f"+{command}" for command in READER_COMMANDS)]


def reader_acl_line() -> str:
    """The ``redis.conf`` line that defines :data:`READER_USER`."""
    return " ".join(["user", READER_USER, *reader_acl_rules()])
