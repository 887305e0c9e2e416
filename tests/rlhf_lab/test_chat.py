"""`rlhf-lab chat` in a real browser: the app runs as its own process on a loopback port,
headless Debian chromium (selenium + chromedriver) sends a message and waits for both models'
replies and the reward to appear in the page, then saves a screenshot.

Then it pastes a 200,000-character message, which the page refuses within seconds with a visible
note (issue 36: it failed after ~120 s with an empty AppError).

The screenshot goes to the test's tmp dir; with CHAT_SCREENSHOT=docs/images/chat.png (and
CHAT_MODELS / CHAT_REWARD_MODEL naming trained checkpoints) the same code makes the README's."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,900",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_chat(models: list[str], reward_model: str | None, port: int, cwd: Path):
    args = [sys.executable, "-m", "rlhf_lab.cli", "chat", *models, "--port", str(port),
            "--threads", "1"]  # fmt: skip
    if reward_model:
        args += ["--reward-model", reward_model]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "GRADIO_ANALYTICS_ENABLED": "False",
           "no_proxy": "127.0.0.1,localhost"}  # fmt: skip
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"chat exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail("the chat page did not come up in 240 s")


def chat_in_browser(url: str, message: str, n_models: int, screenshot: Path, profile: Path,
                    reward: bool) -> tuple[list[str], str, float]:  # fmt: skip
    """Send `message`, wait for every model's reply (and reward), save a screenshot, then paste
    200,000 characters and send them; returns the replies' texts, the page's notice and the
    seconds it took to appear."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        driver.get(url)
        wait = WebDriverWait(driver, 180)
        box = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#message textarea"))
        box.send_keys(message)
        driver.find_element(By.ID, "send").click()

        def replies(d):
            texts = []
            for i in range(n_models):
                bots = d.find_elements(By.CSS_SELECTOR, f"#chat-{i} .message.bot, "
                                       f"#chat-{i} [data-testid='bot']")  # fmt: skip
                text = bots[-1].text.strip() if bots else ""
                if not text or (reward and "reward:" not in
                                d.find_element(By.ID, f"reward-{i}").text):  # fmt: skip
                    return False
                texts.append(text)
            return texts

        texts = wait.until(replies)
        time.sleep(0.5)  # let the last stream frame paint
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(screenshot))
        box = driver.find_element(By.CSS_SELECTOR, "#message textarea")
        driver.execute_script(  # a paste: the value set at once, then the input event
            "const setter = Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, "
            "'value').set; setter.call(arguments[0], arguments[1]);"
            "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));",
            box, "x" * 200_000,
        )  # fmt: skip
        start = time.monotonic()
        driver.find_element(By.ID, "send").click()

        def refused(d):
            text = d.find_element(By.ID, "notice").text
            return text if "not sent" in text else False

        notice = WebDriverWait(driver, 60).until(refused)
        return texts, notice, time.monotonic() - start
    finally:
        driver.quit()


@pytest.mark.skipif(
    not (Path(CHROMIUM).exists() and Path(DRIVER).exists()),
    reason=f"needs Debian's chromium and chromedriver: {INSTALL}",
)
def test_chat_page_in_headless_chromium(tmp_path):
    models = os.environ.get("CHAT_MODELS", "tiny-qwen3 tiny-qwen3").split()
    reward_model = os.environ.get("CHAT_REWARD_MODEL")
    screenshot = Path(os.environ.get("CHAT_SCREENSHOT", tmp_path / "chat.png"))
    port = free_port()
    proc = start_chat(models, reward_model, port, tmp_path)
    try:
        texts, notice, seconds = chat_in_browser(
            f"http://127.0.0.1:{port}/", os.environ.get("CHAT_MESSAGE", "hello"), len(models),
            screenshot, tmp_path / "profile", reward=reward_model is not None,
        )  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert len(texts) == len(models) and all(texts)
    assert "200,000 characters" in notice and seconds < 20, (notice, seconds)
    assert screenshot.stat().st_size > 10_000
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
