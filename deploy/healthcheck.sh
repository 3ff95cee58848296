#!/bin/sh
# The image's HEALTHCHECK (/usr/local/bin/losshead-healthcheck): `losshead health` against the
# server in this container, exit 0 when it is SERVING. The check cannot see the server's flags, so
# the container's environment tells it how the gRPC port speaks:
#
#   LOSSHEAD_HEALTH_PORT             the port of --listen (default 50051), dialled on 127.0.0.1
#   LOSSHEAD_HEALTH_TLS_ROOT_CA      PEM CA that signed the server's --tls_cert: speak TLS and
#                                    verify the server with it (unset: plaintext)
#   LOSSHEAD_HEALTH_TLS_SERVER_NAME  name to verify in the server's certificate (default losshead)
#   LOSSHEAD_HEALTH_TLS_CERT         client certificate and key, for a server that asks for one
#   LOSSHEAD_HEALTH_TLS_KEY          (--tls_client_ca)
#   LOSSHEAD_HEALTH_DEADLINE_S       deadline of the call (default 4: below the HEALTHCHECK timeout)
#
# Health needs no bearer token (--auth_tokens_file leaves it open for probes).
set -eu

fail() {
  echo "losshead-healthcheck: $*" >&2
  exit 1
}

set -- "--server=127.0.0.1:${LOSSHEAD_HEALTH_PORT:-50051}" \
  "--deadline_s=${LOSSHEAD_HEALTH_DEADLINE_S:-4}"
if [ -n "${LOSSHEAD_HEALTH_TLS_ROOT_CA:-}" ]; then
  set -- "$@" "--tls_root_ca=${LOSSHEAD_HEALTH_TLS_ROOT_CA}" \
    "--tls_server_name=${LOSSHEAD_HEALTH_TLS_SERVER_NAME:-losshead}"
else
  # Without the CA the check would speak plaintext to a TLS port and only ever time out.
  for var in LOSSHEAD_HEALTH_TLS_SERVER_NAME LOSSHEAD_HEALTH_TLS_CERT LOSSHEAD_HEALTH_TLS_KEY; do
    eval "value=\${$var:-}"
    [ -z "$value" ] || fail "$var is set but LOSSHEAD_HEALTH_TLS_ROOT_CA is not (TLS needs the CA)"
  done
fi
if [ -n "${LOSSHEAD_HEALTH_TLS_CERT:-}${LOSSHEAD_HEALTH_TLS_KEY:-}" ]; then
  if [ -z "${LOSSHEAD_HEALTH_TLS_CERT:-}" ] || [ -z "${LOSSHEAD_HEALTH_TLS_KEY:-}" ]; then
    fail "LOSSHEAD_HEALTH_TLS_CERT and LOSSHEAD_HEALTH_TLS_KEY go together"
  fi
  set -- "$@" "--tls_cert=${LOSSHEAD_HEALTH_TLS_CERT}" "--tls_key=${LOSSHEAD_HEALTH_TLS_KEY}"
fi
exec /usr/local/bin/losshead health "$@"
