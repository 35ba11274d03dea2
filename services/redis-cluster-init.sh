#!/bin/sh
# Creates the Redis Cluster of docker-compose.yml (its one-shot `redis-init` service runs this script;
# tests/integration runs it natively too). POSIX sh: the official redis images have busybox or dash.
#
# Environment:
#   BAGUA_LIGHTNING_REDIS_HOST      address of the nodes (default 127.0.0.1: the shared namespace)
#   BAGUA_LIGHTNING_REDIS_MASTERS   ports of the masters (default "7000 7001 7002")
#   BAGUA_LIGHTNING_REDIS_REPLICAS  ports of the replicas, one per master; used only when the first answers
#   BAGUA_LIGHTNING_REDIS_INIT_TIMEOUT_S  deadline in seconds (default 60)
#   BAGUA_LIGHTNING_REDIS_PASSWORD_FILE  a file holding the nodes' password (a Compose secret): redis-cli reads
#                                   it on its stdin (--askpass), so it is never in any process's environment
#   REDISCLI_AUTH                   the password itself, if set by the caller instead (read by redis-cli)
#   BAGUA_LIGHTNING_REDIS_TLS_CA, _CERT, _KEY  PEM files: speak TLS to the nodes with this client certificate
#
# Idempotent: a cluster whose nodes all serve every slot is left as it is. A node that forgot the cluster (a
# restarted container: its tmpfs, nodes.conf included, is new) is brought back as a replica of the master
# with the fewest, after the failed entry of its address is forgotten on every node; the others keep their
# data. Exits 0 once every listed node reports all 16384 slots served and knows exactly the listed nodes,
# 1 after the deadline.
set -eu
password_file=${BAGUA_LIGHTNING_REDIS_PASSWORD_FILE:-}
if [ -n "$password_file" ] && [ ! -r "$password_file" ]; then
  echo "redis-cluster-init: cannot read the password file $password_file (BAGUA_LIGHTNING_REDIS_PASSWORD_FILE)" >&2
  exit 1
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

rcli() {  # redis-cli with the TLS options, and the password from its file on stdin when there is one
  if [ -n "$password_file" ]; then
    # shellcheck disable=SC2086  # $tls is a list of words on purpose
    redis-cli --askpass $tls "$@" < "$password_file"
  else
    # shellcheck disable=SC2086
    redis-cli $tls "$@"
  fi
}

info_field() {  # info_field PORT FIELD: one field of CLUSTER INFO, empty when the node does not answer
  rcli -h "$host" -p "$1" cluster info 2>/dev/null | tr -d '\r' | sed -n "s/^$2://p"
}

serves() {  # serves PORT: the node is a member of a cluster that serves every slot
  [ "$(info_field "$1" cluster_state)" = ok ] && [ "$(info_field "$1" cluster_slots_ok)" = 16384 ]
}

served() {  # every listed node serves every slot and knows exactly the listed nodes (gossip has converged)
  # shellcheck disable=SC2086  # lists of words on purpose
  set -- $masters $listed_replicas
  n=$#
  for p in $masters $listed_replicas; do
    serves "$p" && [ "$(info_field "$p" cluster_known_nodes)" = "$n" ] || return 1
  done
}

# Replicas count once the first answers (a deployment with them); then every listed node must be served.
listed_replicas=""
if [ -n "$replicas" ] && rcli -h "$host" -p "${replicas%% *}" ping >/dev/null 2>&1; then
  listed_replicas=$replicas
fi

if served; then
  echo "redis-cluster-init: the cluster already serves all 16384 slots"
  exit 0
fi

nodes=""
for p in $masters $listed_replicas; do nodes="$nodes $host:$p"; done
per_master=0
[ -z "$listed_replicas" ] || per_master=1

anchor=""
for p in $masters $listed_replicas; do
  if serves "$p"; then anchor=$p; break; fi
done

if [ -n "$anchor" ]; then
  # The cluster is formed. Bring back every listed node that answers alone, with no slot: it restarted
  # without its nodes.conf. The others know its old identity as failed, or without an address once they
  # met a new id at it ("noaddr"). A "noaddr" master is never pinged again, so never flagged failed, and its
  # replica would wait forever: the replica is told to take the slots over (CLUSTER FAILOVER TAKEOVER, asked
  # again every 5 s until they move; safe here, the old identity is gone for good, a new one holds its port).
  # Once no such entry holds slots, they are forgotten on every node, and the node is added back as a replica.
  for p in $masters $listed_replicas; do
    if [ "$(info_field "$p" cluster_known_nodes)" != 1 ] || [ "$(info_field "$p" cluster_slots_assigned)" != 0 ]; then
      continue
    fi
    tries=0
    forced=""
    me=$(rcli -h "$host" -p "$p" cluster myid | tr -d '\r')
    while :; do
      table=$(rcli -h "$host" -p "$anchor" cluster nodes | tr -d '\r')
      # Its old identity: another id at its port, or without an address; and any node flagged failed.
      old=$(echo "$table" | awk -v port=":$p@" -v me="$me" '$1 != me && $3 !~ /myself/ \
                  && (index($2, port) || $3 ~ /noaddr/ || $3 ~ /(^|,)fail(,|$)/)')
      [ -n "$(echo "$old" | awk 'NF > 8')" ] || break  # fields 9 on are slots: none left to hand over
      [ $((tries % 10)) = 0 ] && forced=""  # ask again every 5 s
      for id in $(echo "$old" | awk -v port=":$p@" 'NF > 8 && (index($2, port) || $3 ~ /noaddr/) {print $1}'); do
        case " $forced " in *" $id "*) continue ;; esac
        replica=$(echo "$table" \
                  | awk -v m="$id" '$4 == m && $3 ~ /slave/ && $3 !~ /fail/ {split($2, a, "[:@]"); print a[2]; exit}')
        [ -n "$replica" ] || continue
        echo "redis-cluster-init: master $id of port $p is gone with its slots; its replica $replica takes over"
        rcli -h "$host" -p "$replica" cluster failover takeover >/dev/null || true
        forced="$forced $id"
      done
      tries=$((tries + 1))
      if [ "$tries" -gt $((timeout_s * 2)) ]; then
        echo "redis-cluster-init: node $p restarted empty, and a failed node still holds slots after" \
             "${timeout_s} s (no replica took them over)" >&2
        exit 1
      fi
      sleep 0.5
    done
    for id in $(echo "$old" | awk '{print $1}'); do
      for q in $masters $listed_replicas; do
        [ "$q" = "$p" ] || rcli -h "$host" -p "$q" cluster forget "$id" >/dev/null 2>&1 || true
      done
    done
    echo "redis-cluster-init: node $p restarted without its cluster state; adding it back as a replica"
    rcli --cluster add-node "$host:$p" "$host:$anchor" --cluster-slave
  done
elif [ "$(info_field "$first" cluster_slots_assigned)" = 0 ]; then
  # Nodes that already hold slots cannot be joined again: create only while no slot is assigned.
  # shellcheck disable=SC2086  # $nodes is a list of words on purpose
  rcli --cluster create $nodes --cluster-replicas "$per_master" --cluster-yes
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
