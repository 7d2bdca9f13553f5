"""Screenshots of the browser tests, each taken only once the page is checked for horizontal
overflow (no element wider than the viewport), and the list of those taken this session:
``conftest.py`` prints it at the end of the run, so a note can cite each screenshot's path."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Page
from playwright.sync_api import TimeoutError as PlaywrightTimeout

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
WIDE = {"width": 1400, "height": 1000}
NARROW = {"width": 390, "height": 844}
# A tablet, or a laptop's half screen: where a newcomer saw state badges break ("KILL/ED").
MEDIUM = {"width": 820, "height": 1000}
# The state badges (and other one-word labels) that wrap onto a second line.
BROKEN_BADGES_JS = """() => [...document.querySelectorAll(".state")]
  .filter((el) => el.getClientRects().length > 1 ||
                  el.getBoundingClientRect().height > 2 * parseFloat(getComputedStyle(el).fontSize))
  .map((el) => el.textContent)"""

FITS_JS = "() => document.documentElement.scrollWidth <= window.innerWidth"
# The outermost elements that reach past the window's right edge, to say what overflows.
TOO_WIDE_JS = """() => [...document.querySelectorAll("body *")]
  .filter((el) => el.getBoundingClientRect().right > window.innerWidth + 1)
  .filter((el) => el.parentElement.getBoundingClientRect().right <= window.innerWidth + 1)
  .slice(0, 5)
  .map((el) => `${el.tagName.toLowerCase()}.${el.className} ` +
    `${Math.round(el.getBoundingClientRect().right)}px`)"""

# Every screenshot written this session, in the order taken.
TAKEN: list[Path] = []


def assert_fits(page: Page, name: str) -> None:
    """No horizontal scrolling in the page's window at its current size."""
    # Charts resize a frame or two after the window does: wait (bounded) for the layout.
    try:
        page.wait_for_function(FITS_JS, timeout=5_000)
    except PlaywrightTimeout:
        wide, window = page.evaluate(
            "() => [document.documentElement.scrollWidth, window.innerWidth]")
        raise AssertionError(f"{name} is {wide}px wide in a {window}px window; "
                             f"too wide: {page.evaluate(TOO_WIDE_JS)}") from None


def screenshot(page: Page, path: Path) -> None:
    """The whole page as ``path``, once it is checked to fit its window."""
    assert_fits(page, path.stem)
    page.screenshot(path=str(path), full_page=True)
    if path not in TAKEN:
        TAKEN.append(path)


def check_page(page: Page, artifacts: Path, name: str) -> None:
    """``name.png`` wide, ``name-820.png`` and ``name-narrow.png`` on a phone, each checked to
    fit and for state badges broken over two lines."""
    for size, suffix in ((WIDE, ""), (MEDIUM, "-820"), (NARROW, "-narrow")):
        page.set_viewport_size(size)
        screenshot(page, artifacts / f"{name}{suffix}.png")
        broken = page.evaluate(BROKEN_BADGES_JS)
        assert not broken, f"{name} at {size['width']}px breaks these badges: {broken}"
    page.set_viewport_size(WIDE)


def summary_lines() -> list[str]:
    """The screenshots taken, as paths a reader can open from the repository's root."""
    return [str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            for path in TAKEN]
