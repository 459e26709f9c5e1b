"""The pictures in the docs, from SmolLM2: record two chat prompts (sampling, top-p, a repetition
penalty, the last layer's attentions), write the viewer's page, open it in headless Chromium, click a
token and save a screenshot (docs/images/viewer.png); then the `plot` command's PNG files
(docs/images/steps.png, docs/images/attention.png).

    .venv/bin/python examples/docs_images.py [DIRECTORY]

Needs the demo model (scripts/setup.sh), Chromium and chromedriver (setup.sh installs Debian's).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from transformers_offload import Recorder, open_recording
from transformers_offload.answers.plots import plot_attention, plot_steps
from transformers_offload.answers.viewer import write_html
from transformers_offload.demo_model import load

PROMPTS = ["What is the capital of France? Answer in one sentence.", "Name three colours of the rainbow."]


def main() -> None:
    images = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images")
    images.mkdir(parents=True, exist_ok=True)
    out = images / "viewer.png"
    model, tokenizer = load(attn_implementation="eager")
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    enc = tokenizer(chats, return_tensors="pt", padding=True)
    work = Path(tempfile.mkdtemp(prefix="viewer-"))
    try:
        with Recorder(model, streams=("logits", "scores", "attentions"), layers=[-1], heads=[3],
                      spill_dir=work / "run") as rec:
            rec.set_samples(["france", "rainbow"])
            torch.manual_seed(3)
            model.generate(**enc, logits_processor=[rec], do_sample=True, temperature=0.7, top_p=0.9,
                           repetition_penalty=1.1, max_new_tokens=40, pad_token_id=tokenizer.pad_token_id)
        run = open_recording(work / "run")
        write_html(run, work / "page.html", tokenizer=tokenizer)
        plot_steps(run.generation(), images / "steps.png")
        plot_attention(run.generation(), images / "attention.png", layer=-1, head=3, row=0)
        options = webdriver.ChromeOptions()
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,760"):
            options.add_argument(argument)
        options.binary_location = shutil.which("chromium") or "chromium"
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        try:
            driver.get((work / "page.html").as_uri())
            tokens = driver.find_elements(By.CSS_SELECTOR, '.sequence[data-sequence="1"] .tok')
            tokens[1].click()  # " rainbow": top-p kept two of its alternatives
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}, {images / 'steps.png'}, {images / 'attention.png'}")


if __name__ == "__main__":
    main()
