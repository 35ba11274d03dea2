#!/bin/sh
# Makes docker-compose.yml's certificates (its one-shot `certs` service runs this script as root, with
# CAP_CHOWN and CAP_DAC_OVERRIDE only, in the services image): a CA of this deployment, one certificate per Redis node, one for the autotune service,
# and one client certificate for the trainers on the host. The CA's key lives only in a temporary folder
# and is deleted once everything is signed, so nobody can certify another node or client later.
# POSIX sh and the openssl command line (3.0 or later), as services/redis_tls.py: ECDSA P-256, SHA-256,
# ten years. Private keys are written 0600 (umask 077) and never pass a command line.
#
# Environment:
#   BAGUA_LIGHTNING_TLS_DIR         folder for ca.crt, node-<port>.{crt,key}, service.{crt,key} (the nodes'
#                                   and the service's: a named volume), handed to OWNER
#   BAGUA_LIGHTNING_CLIENT_TLS_DIR  folder for ca.crt, client.crt, client.key (the trainers': a folder of the
#                                   host), handed to whoever owns that folder
#   BAGUA_LIGHTNING_REDIS_PORTS     the nodes' ports (default "7000 7001 7002 7003 7004 7005")
#   BAGUA_LIGHTNING_TLS_HOSTS       addresses the nodes and the service are reached at (subjectAltName;
#                                   default "127.0.0.1"; localhost is always added)
#   BAGUA_LIGHTNING_TLS_OWNER       uid:gid of the services' user (default 10001:10001)
#   BAGUA_LIGHTNING_DATA_DIR        optional: a folder (the nodes' data volume) that gets node-<port> for
#                                   each port, 0700, handed to OWNER (made when missing, kept otherwise)
#
# Idempotent: when every file is there, nothing changes (running nodes trust only the CA they started
# with). Otherwise everything is made anew.
set -eu
umask 077
dir=${BAGUA_LIGHTNING_TLS_DIR:?set BAGUA_LIGHTNING_TLS_DIR}
client=${BAGUA_LIGHTNING_CLIENT_TLS_DIR:?set BAGUA_LIGHTNING_CLIENT_TLS_DIR}
ports=${BAGUA_LIGHTNING_REDIS_PORTS:-7000 7001 7002 7003 7004 7005}
hosts=${BAGUA_LIGHTNING_TLS_HOSTS:-127.0.0.1}
owner=${BAGUA_LIGHTNING_TLS_OWNER:-10001:10001}

server_files="ca.crt service.crt service.key"
for p in $ports; do server_files="$server_files node-$p.crt node-$p.key"; done
client_files="ca.crt client.crt client.key"

all_there() {
  for f in $server_files; do [ -s "$dir/$f" ] || return 1; done
  for f in $client_files; do [ -s "$client/$f" ] || return 1; done
  cmp -s "$dir/ca.crt" "$client/ca.crt"
}

data=${BAGUA_LIGHTNING_DATA_DIR:-}
if [ -n "$data" ]; then
  for p in $ports; do
    [ -d "$data/node-$p" ] || { mkdir -m 0700 "$data/node-$p" && chown "$owner" "$data/node-$p"; }
  done
fi

if all_there; then
  echo "compose-certs: certificates already in $dir and $client"
  exit 0
fi

mkdir -p "$dir" "$client"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT INT TERM

san="DNS:localhost"
for h in $hosts; do
  case "$h" in
    *[!0-9.:a-fA-F]*) san="$san,DNS:$h" ;;
    *) san="$san,IP:$h" ;;
  esac
done

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

new_key "$work/ca.key"
openssl req -x509 -new -key "$work/ca.key" -sha256 -days 3650 -subj "/CN=bagua-lightning compose CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out "$work/ca.crt"

# sign NAME USAGES FOLDER [SAN]: FOLDER/NAME.key and FOLDER/NAME.crt, signed by the CA.
sign() {
  new_key "$work/$1.key"
  openssl req -new -x509 -key "$work/$1.key" -CA "$work/ca.crt" -CAkey "$work/ca.key" -sha256 -days 3650 \
    -subj "/CN=$1" -addext "basicConstraints=critical,CA:FALSE" \
    -addext "keyUsage=critical,digitalSignature,keyEncipherment" -addext "extendedKeyUsage=$2" \
    ${4:+-addext "subjectAltName=$4"} -out "$work/$1.crt"
  mv "$work/$1.key" "$work/$1.crt" "$3/"
}

# Nodes: server to clients and peers, client to peers (bus, replication). The service: server to the
# trainers, client of Redis (its plan store).
for p in $ports; do sign "node-$p" serverAuth,clientAuth "$dir" "$san"; done
sign service serverAuth,clientAuth "$dir" "$san"
sign client clientAuth "$client"
cp "$work/ca.crt" "$dir/ca.crt"
cp "$work/ca.crt" "$client/ca.crt"

# shellcheck disable=SC2086  # lists of file names on purpose
# chmod before chown: once a file is another user's, changing its mode would need CAP_FOWNER too.
(cd "$dir" && chmod 0600 $server_files && chown "$owner" $server_files)
client_owner=$(stat -c '%u:%g' "$client")
# shellcheck disable=SC2086
(cd "$client" && chmod 0600 $client_files && chown "$client_owner" $client_files)
echo "compose-certs: made a CA (its key deleted), node, service and client certificates"
