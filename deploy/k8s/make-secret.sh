#!/usr/bin/env bash
# Create the Secrets that the Redis nodes, the autotune service and the trainers share:
#   bagua-lightning-secrets  redis-password, autotune-token, cache-key: each from the matching variable
#                            (BAGUA_LIGHTNING_REDIS_PASSWORD, BAGUA_LIGHTNING_AUTOTUNE_TOKEN,
#                            BAGUA_LIGHTNING_CACHE_KEY: to share them with trainers outside Kubernetes) or
#                            made at random (openssl rand -hex 32)
#   bagua-redis-tls          ca.crt, <pod>.crt and <pod>.key of every Redis node (serverAuth and clientAuth:
#                            the nodes certify each other on the bus, in replication and to clients)
#   bagua-autotune-tls       ca.crt, tls.crt, tls.key: the autotune service's certificate (serverAuth)
#   bagua-lightning-tls      ca.crt, tls.crt, tls.key: the client certificate of trainers, of the autotune
#                            service's Redis store and of the init Job (clientAuth only)
# The certificates come from a fresh CA of this deployment (ECDSA P-256, SHA-256), made in a private
# temporary folder (umask 077) with openssl; the CA's private key is deleted as soon as they are signed, so
# nobody can certify anything else later. Private keys never pass through a command line (openssl writes
# them to files of that folder), and the manifests go to kubectl on stdin.
#
#   deploy/k8s/make-secret.sh               # create what does not exist yet; existing Secrets are left alone
#   deploy/k8s/make-secret.sh --print       # print every manifest instead (e.g. for a sealed-secrets tool)
#   deploy/k8s/make-secret.sh --rotate-tls  # replace the three TLS Secrets: new CA, new certificates
#
# BAGUA_LIGHTNING_NAMESPACE: the namespace (default bagua-lightning). BAGUA_LIGHTNING_CLUSTER_DOMAIN: the
# cluster's DNS domain (default cluster.local). BAGUA_LIGHTNING_REDIS_NODES: the StatefulSet's replicas
# (default 6). BAGUA_LIGHTNING_TLS_EXTRA_NAMES: more names or addresses (comma-separated) that every Redis
# node and the autotune service are reached by, e.g. for trainers outside the cluster.
# BAGUA_LIGHTNING_TLS_DAYS: validity of the certificates (default 825).
set -euo pipefail
umask 077

namespace=${BAGUA_LIGHTNING_NAMESPACE:-bagua-lightning}
domain=${BAGUA_LIGHTNING_CLUSTER_DOMAIN:-cluster.local}
nodes=${BAGUA_LIGHTNING_REDIS_NODES:-6}
extra_names=${BAGUA_LIGHTNING_TLS_EXTRA_NAMES:-}
days=${BAGUA_LIGHTNING_TLS_DAYS:-825}
secrets=bagua-lightning-secrets
tls_secrets=(bagua-redis-tls bagua-autotune-tls bagua-lightning-tls)

fail() {  # fail MESSAGE: one line on stderr, exit 2
  echo "make-secret: $1" >&2
  exit 2
}

[[ $namespace =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] ||
  fail "BAGUA_LIGHTNING_NAMESPACE '$namespace' is not a namespace name (lower-case letters, digits, -)"
[[ $domain =~ ^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$ ]] ||
  fail "BAGUA_LIGHTNING_CLUSTER_DOMAIN '$domain' is not a DNS domain (e.g. cluster.local)"
[[ $nodes =~ ^[1-9][0-9]*$ ]] ||
  fail "BAGUA_LIGHTNING_REDIS_NODES '$nodes' is not a positive number (the StatefulSet's replicas, e.g. 6)"
[[ $days =~ ^[1-9][0-9]*$ ]] || fail "BAGUA_LIGHTNING_TLS_DAYS '$days' is not a positive number of days"
[[ $extra_names =~ ^[A-Za-z0-9.:,*-]*$ ]] ||
  fail "BAGUA_LIGHTNING_TLS_EXTRA_NAMES '$extra_names' holds characters other than letters, digits and .:*- (comma-separated names or addresses)"
command -v openssl >/dev/null || fail "openssl is not on PATH; install it (OpenSSL 3)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# -- secrets ------------------------------------------------------------------------------------------------

value_file() {  # value_file VARIABLE FILE: write $VARIABLE, else a new random secret, to FILE
  local text=${!1:-}
  if [[ -z $text ]]; then
    text=$(openssl rand -hex 32)
  elif [[ $text == *[!A-Za-z0-9._~+/=-]* ]]; then
    fail "$1 holds characters other than letters, digits and ._~+/=-; use e.g. openssl rand -hex 32"
  fi
  printf '%s' "$text" >"$2"
}

secret_manifest() {  # secret_manifest NAME TYPE KEY=FILE...: a Secret with the files' contents
  local name=$1 type=$2 pair
  shift 2
  printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n' "$name" "$namespace"
  printf '  labels:\n    app.kubernetes.io/part-of: bagua-lightning\ntype: %s\ndata:\n' "$type"
  for pair in "$@"; do
    printf '  %s: %s\n' "${pair%%=*}" "$(base64 <"${pair#*=}" | tr -d '\n')"
  done
}

secrets_manifest() {
  value_file BAGUA_LIGHTNING_REDIS_PASSWORD "$work/redis-password"
  value_file BAGUA_LIGHTNING_AUTOTUNE_TOKEN "$work/autotune-token"
  value_file BAGUA_LIGHTNING_CACHE_KEY "$work/cache-key"
  secret_manifest "$secrets" Opaque redis-password="$work/redis-password" \
    autotune-token="$work/autotune-token" cache-key="$work/cache-key"
}

# -- certificates -------------------------------------------------------------------------------------------

ssl() {  # ssl ARGS...: openssl ARGS..., one line naming the failure if it fails
  openssl "$@" 2>"$work/openssl.log" ||
    fail "openssl $1 failed ($(head -n 1 "$work/openssl.log")); OpenSSL 3 or later is needed"
}

new_key() {  # new_key FILE: an ECDSA P-256 private key, written by openssl to FILE (0600 by the umask)
  ssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1"
}

subject_names() {  # subject_names NAME...: the subjectAltName value for NAME... and the extra names
  local name out=() extra
  IFS=, read -ra extra <<<"$extra_names"
  for name in "$@" "${extra[@]}"; do
    [[ -n $name ]] || continue
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then out+=("IP:$name"); else out+=("DNS:$name"); fi
  done
  local IFS=,
  printf '%s' "${out[*]}"
}

sign() {  # sign NAME USAGE NAME...: NAME.key and NAME.crt (CN NAME, extendedKeyUsage USAGE) in $work
  local name=$1 usage=$2
  shift 2
  new_key "$work/$name.key"
  local extra=()
  (($# == 0)) || extra=(-addext "subjectAltName=$(subject_names "$@")")
  ssl req -new -x509 -key "$work/$name.key" -CA "$work/ca.crt" -CAkey "$work/ca.key" -sha256 \
    -days "$days" -subj "/CN=$name" -addext "basicConstraints=critical,CA:FALSE" \
    -addext "keyUsage=critical,digitalSignature" -addext "extendedKeyUsage=$usage" "${extra[@]}" \
    -out "$work/$name.crt"
}

tls_manifests() {
  new_key "$work/ca.key"
  ssl req -x509 -new -key "$work/ca.key" -sha256 -days "$days" \
    -subj "/CN=bagua-lightning $namespace CA $(date -u +%Y%m%dT%H%M%SZ)" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$work/ca.crt"
  local service=bagua-redis.$namespace.svc i pod node_files=(ca.crt="$work/ca.crt")
  for ((i = 0; i < nodes; i++)); do
    pod=bagua-redis-$i
    # The pod's own name (what the node announces), and the headless Service's (any node answers to it).
    sign "$pod" serverAuth,clientAuth "$pod.$service.$domain" "$pod.$service" "$pod.bagua-redis" \
      "$service.$domain" "$service"
    node_files+=("$pod.crt=$work/$pod.crt" "$pod.key=$work/$pod.key")
  done
  sign bagua-autotune serverAuth "bagua-autotune.$namespace.svc.$domain" "bagua-autotune.$namespace.svc" \
    "bagua-autotune.$namespace" bagua-autotune
  extra_names='' sign bagua-lightning-client clientAuth
  rm -f "$work/ca.key"  # nobody can certify anything else from now on
  secret_manifest bagua-redis-tls Opaque "${node_files[@]}"
  secret_manifest bagua-autotune-tls kubernetes.io/tls ca.crt="$work/ca.crt" \
    tls.crt="$work/bagua-autotune.crt" tls.key="$work/bagua-autotune.key"
  secret_manifest bagua-lightning-tls kubernetes.io/tls ca.crt="$work/ca.crt" \
    tls.crt="$work/bagua-lightning-client.crt" tls.key="$work/bagua-lightning-client.key"
}

# -- kubectl ------------------------------------------------------------------------------------------------

exists() {  # exists NAME: the Secret NAME is in the namespace
  kubectl --namespace "$namespace" get secret "$1" >/dev/null 2>&1
}

apply() {  # apply FUNCTION: the manifests FUNCTION prints, to kubectl on stdin (all or nothing)
  local manifests
  manifests=$("$1")
  printf '%s\n' "$manifests" | kubectl apply -f -
}

all_manifests() {
  secrets_manifest
  tls_manifests
}

case ${1:-} in
  --print)
    manifests=$(all_manifests)  # all made before any is printed
    printf '%s\n' "$manifests"
    ;;
  "")
    command -v kubectl >/dev/null || fail "kubectl is not on PATH; install it, or use --print"
    present=()
    for name in "${tls_secrets[@]}"; do
      if exists "$name"; then present+=("$name"); fi
    done
    if ((${#present[@]} > 0 && ${#present[@]} < ${#tls_secrets[@]})); then
      fail "only ${present[*]} of ${tls_secrets[*]} exist in $namespace: their certificates need one CA; run --rotate-tls to replace all three"
    fi
    if exists "$secrets"; then
      echo "make-secret: secret/$secrets exists in $namespace; left as it is (delete it first to rotate)"
    else
      apply secrets_manifest
    fi
    if ((${#present[@]} > 0)); then
      echo "make-secret: the TLS Secrets exist in $namespace; left as they are (--rotate-tls replaces them)"
    else
      apply tls_manifests
    fi
    ;;
  --rotate-tls)
    command -v kubectl >/dev/null || fail "kubectl is not on PATH; install it, or use --print"
    apply tls_manifests
    echo "make-secret: new TLS Secrets applied; restart every Redis node at once, then the autotune service and the trainers (docs/deployment.md)"
    ;;
  *)
    fail "unknown argument '$1'; use no argument, --print or --rotate-tls"
    ;;
esac
