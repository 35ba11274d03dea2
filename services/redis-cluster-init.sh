#!/bin/sh
# Creates the Redis Cluster of docker-compose.yml (its one-shot `redis-init` service runs this script;
# tests/integration runs it natively too). POSIX sh: the official redis images have busybox or dash.
#
# Environment:
#   BAGUA_LIGHTNING_REDIS_HOST      address of the nodes (default 127.0.0.1: the shared namespace)
#   BAGUA_LIGHTNING_REDIS_MASTERS   ports of the masters (default "7000 7001 7002")
#   BAGUA_LIGHTNING_REDIS_REPLICAS  ports of the replicas, one per master; used only when the first answers
#   BAGUA_LIGHTNING_REDIS_INIT_TIMEOUT_S  deadline in seconds (default 60)
#   REDISCLI_AUTH                   the nodes' password, if any (read by redis-cli itself)
#   BAGUA_LIGHTNING_REDIS_PASSWORD_FILE  a file holding the password instead (a Compose secret)
#   BAGUA_LIGHTNING_REDIS_TLS_CA, _CERT, _KEY  PEM files: speak TLS to the nodes with this client certificate
#
# Idempotent: a cluster that already serves every slot is left as it is. Exits 0 once all 16384 slots are
# served by every master, 1 after the deadline.
set -eu
if [ -n "${BAGUA_LIGHTNING_REDIS_PASSWORD_FILE:-}" ]; then
  REDISCLI_AUTH=$(cat "$BAGUA_LIGHTNING_REDIS_PASSWORD_FILE")
  export REDISCLI_AUTH
fi
[ -n "${REDISCLI_AUTH:-}" ] || unset REDISCLI_AUTH
tls=""
if [ -n "${BAGUA_LIGHTNING_REDIS_TLS_CA:-}" ]; then
  tls="--tls --cacert ${BAGUA_LIGHTNING_REDIS_TLS_CA} --cert ${BAGUA_LIGHTNING_REDIS_TLS_CERT:?set with _TLS_CA}"
  tls="$tls --key ${BAGUA_LIGHTNING_REDIS_TLS_KEY:?set with _TLS_CA}"
fi
host=${BAGUA_LIGHTNING_REDIS_HOST:-127.0.0.1}
masters=${BAGUA_LIGHTNING_REDIS_MASTERS:-7000 7001 7002}
replicas=${BAGUA_LIGHTNING_REDIS_REPLICAS:-}
timeout_s=${BAGUA_LIGHTNING_REDIS_INIT_TIMEOUT_S:-60}
first=${masters%% *}

info_field() {  # info_field PORT FIELD: one field of CLUSTER INFO, empty when the node does not answer
  # shellcheck disable=SC2086  # $tls is a list of words on purpose
  redis-cli $tls -h "$host" -p "$1" cluster info 2>/dev/null | tr -d '\r' | sed -n "s/^$2://p"
}

served() {
  for p in $masters; do
    [ "$(info_field "$p" cluster_state)" = ok ] && [ "$(info_field "$p" cluster_slots_ok)" = 16384 ] || return 1
  done
}

if served; then
  echo "redis-cluster-init: the cluster already serves all 16384 slots"
  exit 0
fi

nodes=""
for p in $masters; do nodes="$nodes $host:$p"; done
per_master=0
# shellcheck disable=SC2086
if [ -n "$replicas" ] && redis-cli $tls -h "$host" -p "${replicas%% *}" ping >/dev/null 2>&1; then
  for p in $replicas; do nodes="$nodes $host:$p"; done
  per_master=1
fi

# Nodes that already hold slots cannot be joined again: create only while no slot is assigned.
if [ "$(info_field "$first" cluster_slots_assigned)" = 0 ]; then
  # shellcheck disable=SC2086  # $tls and $nodes are lists of words on purpose
  redis-cli $tls --cluster create $nodes --cluster-replicas "$per_master" --cluster-yes
fi

tries=0
until served; do
  tries=$((tries + 1))
  if [ "$tries" -gt $((timeout_s * 2)) ]; then
    echo "redis-cluster-init: not every slot is served after ${timeout_s} s" >&2
    exit 1
  fi
  sleep 0.5
done
echo "redis-cluster-init: all 16384 slots served by$nodes"
