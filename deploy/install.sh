#!/usr/bin/env bash
# Install corechat as a hardened systemd service; safe to run again (it converges, it never
# overwrites the configuration an operator edited).
#
#   deploy/install.sh                     install on this host (as root) into /opt/corechat
#   deploy/install.sh --root DIR          install into the staging root DIR: no user, no systemctl
#   deploy/install.sh --root DIR --no-pip also skip `pip install` (an empty virtualenv)
#   deploy/install.sh --tls-cert FILE --tls-key FILE
#                                         serve this certificate (chain) and key over HTTPS; without
#                                         them a self-signed certificate is made once
#   deploy/install.sh --dev-model tiny    a trial install: also build a random-weight dev model
#                                         (tiny or qwen2.5-0.5b) into an empty model folder
#
# Needs python3-venv and g++ (the kernels are compiled for this CPU at install).
# Lays out: PREFIX/app (the code), PREFIX/venv, /etc/corechat/corechat.env, the unit in
# /etc/systemd/system, Redis in /etc/redis/redis-corechat.conf (and -kv.conf), nginx in /etc/nginx/conf.d, and the
# model folder /srv/corechat/model (put the model's files there).
set -euo pipefail

usage() {
    sed -n '2,12s/^# \{0,1\}//p' "$0"
    exit "${1:-0}"
}

ROOT=""
PREFIX=/opt/corechat
PIP=1
TLS_CERT=""
TLS_KEY=""
DEV_MODEL=""
PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
        --root) ROOT=$(realpath -m "$2"); shift 2 ;;
        --prefix) PREFIX=$2; shift 2 ;;
        --no-pip) PIP=0; shift ;;
        --tls-cert) TLS_CERT=$(realpath "$2"); shift 2 ;;
        --tls-key) TLS_KEY=$(realpath "$2"); shift 2 ;;
        --dev-model) DEV_MODEL=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; usage 2 >&2 ;;
    esac
done

if [ "${TLS_CERT:+given}" != "${TLS_KEY:+given}" ]; then
    echo "install.sh: --tls-cert and --tls-key go together" >&2
    exit 2
fi

SOURCE=$(cd "$(dirname "$0")/.." && pwd)
APP="$ROOT$PREFIX/app"
VENV="$ROOT$PREFIX/venv"

# On the host, run it; in a staging root, say what would run.
host() {
    if [ -n "$ROOT" ]; then
        echo "staging root, not run: $*"
    else
        "$@"
    fi
}

# Install a configuration file once; later runs leave the operator's edits alone.
install_config() {
    local source=$1 target=$ROOT$2 mode=$3 group=$4
    if [ -e "$target" ]; then
        echo "kept $2 (exists)"
        return
    fi
    install -D -m "$mode" "$source" "$target"
    sed -i -e "s/CHANGE-ME-corechat-redis-password/$REDIS_PASSWORD/" \
           -e "s/CHANGE-ME-admin-redis-password/$REDIS_ADMIN_PASSWORD/" "$target"
    host chgrp "$group" "$target"
    echo "installed $2"
}

# Reuse the passwords of an installed Redis config, so a new env file matches it.
redis_password() {
    local user=$1 conf=$ROOT/etc/redis/redis-corechat.conf
    if [ -e "$conf" ]; then
        sed -n "s/^user $user on >\([^ ]*\) .*/\1/p" "$conf"
    else
        head -c 24 /dev/urandom | base64 | tr -d '/+='
    fi
}

if [ -n "$DEV_MODEL" ] && [ "$PIP" = 0 ]; then
    echo "install.sh: --dev-model needs pip (drop --no-pip)" >&2
    exit 2
fi
if [ -z "$ROOT" ] && [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root, or use --root DIR to stage" >&2
    exit 1
fi

host sh -c 'getent passwd corechat >/dev/null || useradd --system --user-group --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin corechat'

# The code (with any templates and static files under service/): replaced whole, so files removed
# upstream disappear here too.
rm -rf "$APP.new"
install -d -m 0755 "$APP.new"
(cd "$SOURCE" && find service -type f ! -path '*/__pycache__/*' -print0 | sort -z;
    printf '%s\0' wsgi.py gunicorn.conf.py requirements.txt README.md) |
    while IFS= read -r -d '' file; do
        install -D -m 0644 "$SOURCE/$file" "$APP.new/$file"
    done
rm -rf "$APP"
mv "$APP.new" "$APP"

if [ ! -x "$VENV/bin/python" ]; then
    if [ "$PIP" = 1 ]; then "$PYTHON" -m venv "$VENV"; else "$PYTHON" -m venv --without-pip "$VENV"; fi
fi
if [ "$PIP" = 1 ]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -r "$APP/requirements.txt"
    "$VENV/bin/python" -m compileall -q "$APP"
    # corechat's C++ kernels, compiled here for this CPU with g++ (a minute), into the venv.
    (cd "$APP" && "$VENV/bin/python" -m service.engine.kernels)
fi

REDIS_PASSWORD=$(redis_password corechat)
REDIS_ADMIN_PASSWORD=$(redis_password admin)
install_config "$SOURCE/deploy/corechat.env.example" /etc/corechat/corechat.env 0640 corechat
install_config "$SOURCE/deploy/redis/corechat.conf" /etc/redis/redis-corechat.conf 0640 redis
install_config "$SOURCE/deploy/redis/corechat-kv.conf" /etc/redis/redis-corechat-kv.conf 0640 redis
install_config "$SOURCE/deploy/nginx/corechat.conf" /etc/nginx/conf.d/corechat.conf 0644 root
# nginx serves HTTPS only, from these two files: a certificate given here replaces them; without
# one, a self-signed certificate is made once (replace it before other hosts' clients use the API).
TLS_DIR=$ROOT/etc/corechat/tls
if [ -n "$TLS_CERT" ]; then
    install -d -m 0700 "$TLS_DIR"
    install -m 0644 "$TLS_CERT" "$TLS_DIR/fullchain.pem"
    install -m 0600 "$TLS_KEY" "$TLS_DIR/privkey.pem"
    echo "installed the TLS certificate $TLS_CERT in /etc/corechat/tls"
elif [ ! -e "$TLS_DIR/fullchain.pem" ]; then
    "$SOURCE/deploy/nginx/make-tls-cert.sh" "$TLS_DIR"
    echo "made a self-signed TLS certificate in /etc/corechat/tls: replace it with a real one (docs/deploy.md)"
fi
# The unit is ours, not the operator's: always the shipped one (change it with drop-ins).
install -D -m 0644 "$SOURCE/deploy/systemd/corechat.service" "$ROOT/etc/systemd/system/corechat.service"
# The unit lets corechat exchange packets with loopback only; ALLOWED_NETWORKS of the environment
# file (a BIND on other interfaces) adds to that in a drop-in, rewritten by every run.
ALLOWED=$(sed -n 's/^ALLOWED_NETWORKS=//p' "$ROOT/etc/corechat/corechat.env" | tail -n 1 | tr -d "\"'" | tr ',' ' ' | xargs)
DROPIN=$ROOT/etc/systemd/system/corechat.service.d/allowed-networks.conf
if [ -n "${ALLOWED// /}" ]; then
    install -d -m 0755 "$(dirname "$DROPIN")"
    printf '# Written by install.sh from ALLOWED_NETWORKS in /etc/corechat/corechat.env: change it there, then run install.sh.\n[Service]\nIPAddressAllow=%s\n' "$ALLOWED" > "$DROPIN"
else
    rm -f "$DROPIN"
fi
install -d -m 0755 "$ROOT/srv/corechat/model"
if [ -n "$DEV_MODEL" ]; then
    # Only for a trial: the dev model's builder needs packages serving never does, and its text is gibberish.
    if [ -e "$ROOT/srv/corechat/model/config.json" ] && [ ! -e "$ROOT/srv/corechat/model/corechat-devmodel.json" ]; then
        echo "install.sh: $ROOT/srv/corechat/model holds a model that is not a dev model; not replacing it" >&2
        exit 1
    fi
    "$VENV/bin/python" -m pip install --quiet -r "$SOURCE/requirements-devmodel.txt"
    (cd "$SOURCE" && "$VENV/bin/python" -B -m devtools.devmodel "$ROOT/srv/corechat/model" --preset "$DEV_MODEL" >/dev/null)
fi

# Debian's default nginx site also listens on port 80, as its default server: it would answer there
# instead of corechat (nginx warns of a "conflicting server name"). Disable it; its file stays in
# sites-available. A site of that name that is not Debian's link is the operator's: kept, and said.
DEFAULT_SITE=/etc/nginx/sites-enabled/default
if [ "$(readlink "$ROOT$DEFAULT_SITE" 2>/dev/null)" = /etc/nginx/sites-available/default ]; then
    rm "$ROOT$DEFAULT_SITE"
    echo "disabled Debian's default nginx site ($DEFAULT_SITE), which took port 80 from corechat"
elif [ -e "$ROOT$DEFAULT_SITE" ]; then
    echo "install.sh: kept $DEFAULT_SITE (not Debian's default link): if it listens on port 80, it answers there, not corechat" >&2
fi

host systemctl daemon-reload
host systemctl enable --now redis-server@corechat.service redis-server@corechat-kv.service
host systemctl enable corechat.service
host systemctl restart corechat.service
host sh -c 'nginx -t && systemctl reload nginx'
echo "corechat installed in $ROOT$PREFIX"
