#!/usr/bin/env bash
# Create the Secret bagua-lightning-secrets (keys redis-password, autotune-token, cache-key) that the
# Redis nodes, the autotune service and the trainers share. Each value is taken from the matching variable
# (BAGUA_LIGHTNING_REDIS_PASSWORD, BAGUA_LIGHTNING_AUTOTUNE_TOKEN, BAGUA_LIGHTNING_CACHE_KEY: to share the
# secrets with trainers outside Kubernetes) or made at random (openssl rand -hex 32). The manifest goes to
# kubectl on stdin: no secret ever lands on a command line or in a file.
#
#   deploy/k8s/make-secret.sh           # create it, unless it exists (delete it first to rotate)
#   deploy/k8s/make-secret.sh --print   # print the manifest instead (e.g. for a sealed-secrets tool)
#
# BAGUA_LIGHTNING_NAMESPACE: the namespace (default bagua-lightning).
set -euo pipefail

namespace=${BAGUA_LIGHTNING_NAMESPACE:-bagua-lightning}
name=bagua-lightning-secrets

value() {  # value VARIABLE: base64 of $VARIABLE, else of a new random secret
  local text=${!1:-}
  if [[ -z $text ]]; then
    text=$(openssl rand -hex 32)
  elif [[ $text == *[!A-Za-z0-9._~+/=-]* ]]; then
    echo "make-secret: $1 holds characters other than letters, digits and ._~+/=-; use e.g. openssl rand -hex 32" >&2
    exit 2
  fi
  printf '%s' "$text" | base64 | tr -d '\n'
}

manifest() {
  local redis_password autotune_token cache_key
  redis_password=$(value BAGUA_LIGHTNING_REDIS_PASSWORD)
  autotune_token=$(value BAGUA_LIGHTNING_AUTOTUNE_TOKEN)
  cache_key=$(value BAGUA_LIGHTNING_CACHE_KEY)
  cat <<MANIFEST
apiVersion: v1
kind: Secret
metadata:
  name: $name
  namespace: $namespace
  labels:
    app.kubernetes.io/part-of: bagua-lightning
type: Opaque
data:
  redis-password: $redis_password
  autotune-token: $autotune_token
  cache-key: $cache_key
MANIFEST
}

case ${1:-} in
  --print)
    manifest
    ;;
  "")
    if kubectl --namespace "$namespace" get secret "$name" >/dev/null 2>&1; then
      echo "make-secret: secret/$name exists in $namespace; left as it is (delete it first to rotate)"
      exit 0
    fi
    manifest | kubectl apply -f -
    ;;
  *)
    echo "make-secret: unknown argument '$1'; use no argument or --print" >&2
    exit 2
    ;;
esac
