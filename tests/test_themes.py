import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
from textual.app import App, ComposeResult
from textual.color import Color
from textual.theme import Theme
from textual.widgets import Button, Footer, Input, Markdown, TextArea

from tuichat.themes import bundled_themes_dir, load_themes, theme_from_dict, user_themes_dir
from tuichat.ui.measure import until

CHECKOUT_THEMES = Path(__file__).resolve().parent.parent / "tuichat" / "themes"


@pytest.fixture
def no_user_themes(tmp_path):
    return tmp_path / "no-themes"


def contrast(a: str, b: str) -> float:
    """WCAG 2 contrast ratio."""

    def luminance(colour: str) -> float:
        def linear(c: int) -> float:
            c /= 255
            return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

        r, g, b = Color.parse(colour).rgb
        return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b)

    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


class ThemedApp(App):
    """Widgets that use the theme variables, so a bad variable would fail to apply."""

    def compose(self) -> ComposeResult:
        yield Markdown("# Title\n\nSome *text* and `code`.")
        yield Input("typed")
        yield TextArea("multi\nline")
        yield Button("Send", variant="primary")
        yield Footer()


def test_bundled_themes_are_the_checkouts_and_load_without_warnings(no_user_themes):
    assert Path(str(bundled_themes_dir())) == CHECKOUT_THEMES  # test_packaging covers the installed cases
    themes, warnings = load_themes(no_user_themes)
    assert warnings == []
    in_files = sorted(tomllib.loads(path.read_text())["name"] for path in CHECKOUT_THEMES.glob("*.toml"))
    assert sorted(t.name for t in themes) == in_files
    assert {"tuichat-dark", "tuichat-light", "tuichat-high-contrast", "tuichat-solarized-light"} <= set(in_files)
    assert {True, False} <= {t.dark for t in themes}


def test_each_bundled_theme_is_dark_or_light_as_it_says(no_user_themes):
    for theme in load_themes(no_user_themes)[0]:
        against_black, against_white = contrast(theme.background, "#000000"), contrast(theme.background, "#ffffff")
        assert theme.dark == (against_white > against_black), theme.name
        assert contrast(theme.foreground, theme.background) >= 4.5, theme.name  # WCAG AA for body text


def test_high_contrast_theme_meets_wcag_aaa_everywhere(no_user_themes):
    [theme] = [t for t in load_themes(no_user_themes)[0] if t.name == "tuichat-high-contrast"]
    assert contrast(theme.foreground, theme.background) == 21
    for key in ("primary", "secondary", "accent", "success", "warning", "error"):
        assert contrast(getattr(theme, key), theme.background) >= 7, key


async def test_bundled_themes_apply_in_a_textual_app(no_user_themes):
    themes, _ = load_themes(no_user_themes)
    app = ThemedApp()
    async with app.run_test():
        for theme in themes:
            app.register_theme(theme)
        for theme in themes:
            app.theme = theme.name
            assert app.current_theme.name == theme.name
            await until(lambda: app.screen.styles.background == Color.parse(theme.background), theme.name)


def write(folder, name, text):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text, encoding="utf-8")


def test_broken_user_themes_are_skipped_with_a_warning_and_the_rest_load(tmp_path):
    user = tmp_path / "themes"
    broken = {
        "bad-toml.toml": 'name = "x"\nprimary = \n',
        "no-primary.toml": 'name = "no-primary"\n',
        "no-name.toml": 'primary = "#ff0000"\n',
        "bad-colour.toml": 'name = "bad-colour"\nprimary = "#ff0000"\nbackground = "blurple"\n',
        "bad-variable.toml": 'name = "bad-variable"\nprimary = "red"\n[variables]\nfooter-key-foreground = "nope"\n',
        "bad-style.toml": 'name = "bad-style"\nprimary = "red"\n[variables]\nblock-cursor-text-style = "sparkly"\n',
        "typo.toml": 'name = "typo"\nprimry = "red"\nprimary = "red"\n',
        "not-bool.toml": 'name = "not-bool"\nprimary = "red"\ndark = "yes"\n',
        "binary.toml": "",
    }
    for name, text in broken.items():
        write(user, name, text)
    (user / "binary.toml").write_bytes(b"\xff\xfe\x00")
    write(user, "mine.toml", 'name = "mine"\nprimary = "#123456"\ndark = false\n[variables]\nborder = "#abcdef 50%"\n')

    themes, warnings = load_themes(user)
    assert len(warnings) == len(broken)
    for name in broken:
        [warning] = [w for w in warnings if str(user / name) in w]
        assert "skipped" in warning
    assert any("blurple" in w for w in warnings) and any('"primary" is missing' in w for w in warnings)
    names = [t.name for t in themes]
    assert "mine" in names and "tuichat-dark" in names
    assert not set(names) & {"x", "no-primary", "bad-colour", "bad-variable", "bad-style", "typo", "not-bool"}


def test_a_user_theme_replaces_the_bundled_one_of_the_same_name(tmp_path):
    user = tmp_path / "themes"
    write(user, "dark.toml", 'name = "tuichat-dark"\nprimary = "#ff00ff"\n')
    bundled_names = [t.name for t in load_themes(tmp_path / "none")[0]]
    themes, warnings = load_themes(user)
    assert warnings == []
    assert [t.name for t in themes] == bundled_names  # same place in the list
    assert [t.primary for t in themes if t.name == "tuichat-dark"] == ["#ff00ff"]


def test_default_user_folder_is_in_the_config_dir(user_dirs):
    assert user_themes_dir() == user_dirs.config / "themes"
    write(user_themes_dir(), "mine.toml", 'name = "mine"\nprimary = "red"\n')
    assert "mine" in [t.name for t in load_themes()[0]]


def test_theme_from_dict_accepts_every_theme_argument():
    data = {"name": "full", "primary": "ansi_red", "secondary": "#00ff00", "warning": "yellow", "error": "red",
            "success": "green", "accent": "blue", "foreground": "#eeeeee", "background": "#111111",
            "surface": "#222222", "panel": "#333333", "boost": "#444444", "dark": True, "luminosity_spread": 0.2,
            "text_alpha": 1, "ansi": True,
            "variables": {"input-selection-background": "#ff0000 30%", "button-focus-text-style": "reverse"}}
    assert set(data) == {field.name for field in fields(Theme)}
    theme = theme_from_dict(data)
    assert {key: getattr(theme, key) for key in data} == data
