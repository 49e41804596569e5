"""The chat page at GET /, driven in a real headless browser (Debian's chromium and chromedriver).

Skipped, with the reason, where that browser is not installed; .ci/run installs it."""

import shutil
import time
from pathlib import Path

import pytest
from conftest import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")]

API_KEY = "page-key"
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def served(default_model_dir):
    import minillm
    from minillm.serving.server import create_app

    with minillm.load(default_model_dir, ctx=2048) as llm:
        llm.eos_ids = ()  # replies run to max_tokens, so there is a long one to stop
        with running_server(create_app(llm, "smollm2", API_KEY)) as url:
            yield url, llm


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(predicate, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def running(base):
    try:  # the openai package brings httpx2 (same API) or httpx
        import httpx2 as httpx
    except ImportError:
        import httpx

    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("minillm:num_requests_running "):
            return float(line.split()[1])


def send(driver, text):
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def replies(driver):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def set_field(driver, field, value):
    from selenium.webdriver.common.by import By

    element = driver.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)


def test_chat_page_streams_stops_continues_and_escapes(served, browser):
    from selenium.webdriver.common.by import By

    base, llm = served
    driver = browser
    driver.get(base + "/")
    set_field(driver, "api-key", API_KEY)
    assert driver.execute_script("return localStorage.getItem('minillm-api-key')") == API_KEY
    set_field(driver, "max-tokens", "24")
    set_field(driver, "seed", "1")

    # a streamed reply
    send(driver, "Name three colors.")
    reply = wait_for(lambda: [r for r in replies(driver) if "done" in r.get_attribute("class")])[-1]
    assert reply.find_element(By.CLASS_NAME, "body").text.strip()
    stats = reply.find_element(By.CLASS_NAME, "stats").text
    assert "tok/s" in stats and "cached prompt tokens" in stats

    # a long reply, stopped while it streams: the engine frees the slot
    set_field(driver, "max-tokens", "1500")
    send(driver, "Tell me a very long story about the sea.")
    wait_for(lambda: len(replies(driver)) == 2 and len(replies(driver)[-1].find_element(By.CLASS_NAME, "body").text) > 20)
    assert running(base) == 1
    driver.find_element(By.ID, "stop").click()
    wait_for(lambda: "stopped" in replies(driver)[-1].find_element(By.CLASS_NAME, "stats").text)
    wait_for(lambda: running(base) == 0, 30)

    # the conversation goes on: a second turn, sent with the history
    set_field(driver, "max-tokens", "12")
    send(driver, "Thanks! And one more color?")
    wait_for(lambda: len(replies(driver)) == 3 and "done" in replies(driver)[-1].get_attribute("class"))
    assert driver.execute_script("return window.minillmChat.history.length") == 6

    # model output holding markup is shown as text: the reply is forced (a grammar) to be a script tag
    set_field(driver, "max-tokens", "60")
    set_field(driver, "extra", '{"grammar": {"type": "regex", "grammar": "<script>window.pwned = 1</script><b>bold</b>"}}')
    send(driver, "Anything.")
    reply = wait_for(lambda: len(replies(driver)) == 4 and "done" in replies(driver)[-1].get_attribute("class") and replies(driver)[-1])
    body = reply.find_element(By.CLASS_NAME, "body")
    assert body.text == "<script>window.pwned = 1</script><b>bold</b>"
    assert not body.find_elements(By.TAG_NAME, "script") and not body.find_elements(By.TAG_NAME, "b")
    assert driver.execute_script("return window.pwned") is None
    set_field(driver, "extra", "")


def test_errors_from_the_server_are_shown(served, browser):
    from selenium.webdriver.common.by import By

    base, _ = served
    driver = browser
    driver.get(base + "/")
    set_field(driver, "api-key", "wrong-key")
    send(driver, "hello")
    error = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.error"))[0]
    assert "invalid API key" in error.text
    set_field(driver, "api-key", API_KEY)


def test_screenshots_at_desktop_and_phone_widths(served, browser, tmp_path):
    """Screenshots at desktop and phone widths; with MINILLM_UPDATE_DOCS=1 into docs/ (committed,
    for the README), else into a temporary directory."""
    import os

    out = DOCS if os.environ.get("MINILLM_UPDATE_DOCS") else tmp_path
    base, _ = served
    driver = browser
    driver.get(base + "/")
    set_field(driver, "api-key", API_KEY)
    set_field(driver, "max-tokens", "60")
    set_field(driver, "seed", "4")
    send(driver, "Write a haiku about a lighthouse, then show `print('hi')` in a code block.")
    wait_for(lambda: replies(driver) and "done" in replies(driver)[-1].get_attribute("class"))
    out.mkdir(exist_ok=True)
    for name, size in (("chat-desktop.png", (1280, 800)), ("chat-phone.png", (390, 844))):
        driver.set_window_size(*size)
        if name == "chat-phone.png":  # as a phone opens it: settings folded away
            driver.execute_script("document.getElementById('settings').open = false; window.scrollTo(0, 0)")
        time.sleep(0.3)
        path = out / name
        assert driver.save_screenshot(str(path)) and path.stat().st_size > 5000
    driver.set_window_size(1280, 900)
