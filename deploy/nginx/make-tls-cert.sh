#!/usr/bin/env bash
# Make a self-signed TLS certificate for nginx, so corechat serves HTTPS from its first start:
#
#   deploy/nginx/make-tls-cert.sh DIR [HOSTNAME]    writes DIR/fullchain.pem and DIR/privkey.pem
#
# Valid for two years for HOSTNAME (default: this host's name), localhost, 127.0.0.1 and ::1.
# Clients must be told to trust it (curl --cacert DIR/fullchain.pem); replace it with a real
# certificate before clients on other hosts use the service (docs/deploy.md).
set -euo pipefail

DIR=${1:?usage: make-tls-cert.sh DIR [HOSTNAME]}
NAME=${2:-$(hostname -f 2>/dev/null || hostname)}
install -d -m 0700 "$DIR"
# The key is never readable by anyone but root (nginx reads it before it drops privileges).
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 730 \
    -subj "/CN=$NAME" -addext "subjectAltName=DNS:$NAME,DNS:localhost,IP:127.0.0.1,IP:::1" \
    -keyout "$DIR/privkey.pem" -out "$DIR/fullchain.pem" 2>/dev/null
chmod 0644 "$DIR/fullchain.pem"
