"""Write deploy/corechat.env.example from the Settings class: every setting, its default, its description.

Run `python deploy/gen_env_example.py > deploy/corechat.env.example` after adding a setting; a test
checks that the committed file is what this prints. With `--markdown` it prints the settings table
of docs/configuration.md instead (between its `<!-- settings -->` markers, also checked by a test).
"""

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service.settings import Settings  # noqa: E402

HEADER = """\
# corechat settings, read by the systemd unit (EnvironmentFile=/etc/corechat/corechat.env).
# Generated from service/settings.py by deploy/gen_env_example.py: do not edit the example by hand.
# Every setting is listed with its default (commented out); uncomment a line to change it.
# Lines that are not commented are values a production host needs that differ from the defaults.
"""

# Production values that differ from the developer defaults: the model lives in a read-only folder
# outside any home directory (the unit sets ProtectHome=), and Redis is the hardened local instance
# of deploy/redis/corechat.conf (and KV state its own, deploy/redis/corechat-kv.conf), whose password
# install.sh generates. Names absent from Settings
# are skipped, so the example stays valid on branches without those settings.
PRODUCTION_VALUES = {
    "model": "/srv/corechat/model",
    "redis_url": "redis://corechat:CHANGE-ME-corechat-redis-password@127.0.0.1:6380/0",
    "shared_kv_redis_url": "redis://corechat:CHANGE-ME-corechat-redis-password@127.0.0.1:6381/0",
}


def render_value(value) -> str:
    """Render a default as an environment-file value, with the home folder as `~`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = "" if value is None else str(value)
    home = str(Path.home())
    return "~" + text[len(home) :] if text.startswith(home + "/") else text


def render_env_example() -> str:
    """Return the example environment file for every field of Settings."""
    blocks = [HEADER]
    for name, field in Settings.model_fields.items():
        comment = textwrap.wrap(field.description or "", width=96)
        lines = [f"# {line}" for line in comment]
        default = f"{name.upper()}={render_value(field.default)}"
        if name in PRODUCTION_VALUES:
            lines += [f"# Default: {default}", f"{name.upper()}={PRODUCTION_VALUES[name]}"]
        else:
            lines.append(f"#{default}")
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


def render_markdown_table() -> str:
    """Return docs/configuration.md's table of every setting: variable, default, meaning."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = render_value(field.default) or "(empty)"
        rows.append(f"| `{name.upper()}` | `{default}` | {field.description or ''} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown_table() if "--markdown" in sys.argv[1:] else render_env_example())
