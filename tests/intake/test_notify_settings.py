"""The notify settings group: the webhook URL from a flag or a (Secret) file, checked at start."""

from __future__ import annotations

import pytest

from resilienced.errors import ConfigError
from resilienced.settings import NotifySettings

pytestmark = pytest.mark.unit


def test_the_webhook_file_is_read_and_checked_without_echoing_it(tmp_path):
    path = tmp_path / "webhook-url"
    settings = NotifySettings.from_args(None, {"RESILIENCED_NOTIFY_WEBHOOK_FILE": str(path)})
    assert settings.webhook_url() is None  # no Secret mounted: notifications off
    path.write_text("https://hooks.example.com/services/T0/B0/secret\n")
    settings.validate()
    assert settings.webhook_url() == "https://hooks.example.com/services/T0/B0/secret"
    path.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        settings.validate()
    path.write_text("hooks.example.com/services/secret")
    with pytest.raises(ConfigError, match="does not hold an http") as caught:
        settings.validate()
    assert "secret" not in caught.value.message.replace(str(path), "")
    both = NotifySettings(notify_webhook="https://a.example.com/x", notify_webhook_file=str(path))
    with pytest.raises(ConfigError, match="not both"):
        both.validate()
    with pytest.raises(ConfigError, match="--notify-template"):
        NotifySettings(notify_template="t.json").validate()
