#!/usr/bin/env python3
"""The chat page at / in headless Chromium, driven over the DevTools protocol (--remote-debugging-pipe:
JSON messages ending in NUL on fds 3 and 4, so no WebSocket client is needed).

1. `sparsemla serve` on the given model (ctest passes the bundled one), on a free port.
2. The page renders a crafted stream (a stubbed fetch) with reasoning: the reasoning shows in a
   collapsed <details>, the answer beside it.
3. A real chat: the message is typed and sent through the page's own controls; the streamed reply
   must equal what the API answers for the same request without streaming.

usage: chat_page_test.py SPARSEMLA_BINARY MODEL.gguf [CHROMIUM]   (the bundled model answers best)
Exits 77 (skipped) when Chromium is not installed. SPARSEMLA_SCREENSHOT=file.png saves the page.
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

SKIP = 77
QUESTION = "Give me a fortune cookie."


class DevTools:
    """A DevTools-protocol session with one page over Chromium's pipe."""

    def __init__(self, chromium, user_dir):
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()

        def fds():  # in the child: its end of each pipe at 3 (commands in) and 4 (replies out)
            a, b = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", "--no-default-browser-check", f"--user-data-dir={user_dir}",
             "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self.next_id = 0
        self.buffer = b""
        self.session = None

    def call(self, method, params=None, timeout=20):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self.to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            chunk = os.read(self.from_child, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self.buffer += chunk
        raise TimeoutError(method)

    def attach_to_page(self):
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]

    def evaluate(self, expression, timeout=20):
        r = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True},
                      timeout=timeout)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def close(self):
        self.proc.kill()
        self.proc.wait()


def wait_for(dt, condition, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if dt.evaluate(condition):
            return
        time.sleep(0.05)
    raise TimeoutError(condition)


def post_json(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def start_server(binary, model):
    proc = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--threads", "2", "--ctx-size", "512",
                             "--max-seqs", "2"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        raise RuntimeError(f"serve printed {line!r}")
    base = line.split()[-1]
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except Exception:
            time.sleep(0.05)
    raise TimeoutError("the server never became healthy")


# A stream the page must render: reasoning, then the answer, then usage.
STUB_FETCH = r"""
(() => {
  const events = [
    {choices: [{index: 0, delta: {role: "assistant", content: ""}, finish_reason: null}]},
    {choices: [{index: 0, delta: {reasoning_content: "The user greets; "}, finish_reason: null}]},
    {choices: [{index: 0, delta: {reasoning_content: "greet back."}, finish_reason: null}]},
    {choices: [{index: 0, delta: {content: "Hello "}, finish_reason: null}]},
    {choices: [{index: 0, delta: {content: "to you!"}, finish_reason: null}]},
    {choices: [{index: 0, delta: {}, finish_reason: "stop"}]},
    {choices: [], usage: {prompt_tokens: 5, completion_tokens: 7, total_tokens: 12}},
  ];
  window.realFetch = window.fetch;
  window.fetch = async (url, opts) => {
    if (!String(url).endsWith("/v1/chat/completions")) return window.realFetch(url, opts);
    const enc = new TextEncoder();
    const body = new ReadableStream({
      async start(c) {
        for (const e of events) {
          const s = "data: " + JSON.stringify(e) + "\n\n";
          c.enqueue(enc.encode(s.slice(0, 7)));  // events cut mid-way, as the network may
          await new Promise(r => setTimeout(r, 5));
          c.enqueue(enc.encode(s.slice(7)));
        }
        c.enqueue(enc.encode("data: [DONE]\n\n"));
        c.close();
      }
    });
    return new Response(body, {status: 200, headers: {"Content-Type": "text/event-stream"}});
  };
  return true;
})()
"""


def send_message(dt, text):
    dt.evaluate(f"""(() => {{
      const input = document.getElementById("input");
      input.value = {json.dumps(text)};
      input.dispatchEvent(new Event("input"));
      document.getElementById("send").click();
      return true;
    }})()""")
    wait_for(dt, "!window.chatState.busy && document.querySelector('.msg.assistant:last-child')?.dataset.done === '1'")


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    binary, model = sys.argv[1], sys.argv[2]
    chromium = sys.argv[3] if len(sys.argv) > 3 else "chromium"
    chromium = shutil.which(chromium)
    if not chromium:
        print("SKIP: chromium is not installed")
        return SKIP

    server, base = start_server(binary, model)
    user_dir = tempfile.mkdtemp(prefix="sparsemla-chromium-")
    dt = DevTools(chromium, user_dir)
    failures = []

    def check(ok, what):
        print(("ok  " if ok else "FAIL") + " " + what)
        if not ok:
            failures.append(what)

    try:
        dt.attach_to_page()
        dt.call("Page.enable")
        dt.call("Page.navigate", {"url": base + "/"})
        wait_for(dt, "document.readyState === 'complete' && !!window.chatState && !!window.chatState.model")
        name = os.path.splitext(os.path.basename(model))[0]
        check(dt.evaluate("document.getElementById('model').textContent") == name, "the page names the model")

        # 2. Reasoning from a crafted stream.
        dt.evaluate(STUB_FETCH)
        send_message(dt, "Hi!")
        view = dt.evaluate("""(() => {
          const a = document.querySelector('.msg.assistant:last-child');
          const d = a.querySelector('details.reasoning');
          return {hasDetails: !!d, open: d ? d.open : null, reasoning: d ? d.querySelector('.text').textContent : null,
                  summary: d ? d.querySelector('summary').textContent : null,
                  content: a.querySelector('.content').textContent, status: document.getElementById('status').textContent};
        })()""")
        check(view["hasDetails"], "reasoning is shown in a <details>")
        check(view["open"] is False, "the reasoning is collapsed")
        check(view["reasoning"] == "The user greets; greet back.", f"the reasoning text ({view['reasoning']!r})")
        check(view["content"] == "Hello to you!", f"the answer beside it ({view['content']!r})")
        check("5 prompt + 7 generated" in view["status"], f"usage in the status line ({view['status']!r})")
        dt.evaluate("window.fetch = window.realFetch; document.getElementById('clear').click(); true")

        # 3. A real chat, through the page's controls, against the API.
        dt.evaluate("""(() => {
          document.getElementById('temperature').value = '0';
          document.getElementById('max-tokens').value = '48';
          return true; })()""")
        send_message(dt, QUESTION)
        page = dt.evaluate("""(() => ({
          history: window.chatState.history,
          shown: document.querySelector('.msg.assistant:last-child .content').textContent,
          error: document.querySelector('.msg.error') ? document.querySelector('.msg.error').textContent : null,
          status: document.getElementById('status').textContent }))()""")
        check(page["error"] is None, f"no error ({page['error']!r})")
        check(len(page["history"]) == 2, "the exchange is in the history")
        api = post_json(base + "/v1/chat/completions", {
            "model": name, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 48})
        want = api["choices"][0]["message"]["content"]
        got = page["history"][1]["content"] if len(page["history"]) == 2 else None
        check(got == want, f"the streamed reply equals the API's ({got!r} vs {want!r})")
        check(page["shown"] == want, "and the page shows it")
        check(f"+ {api['usage']['completion_tokens']} generated" in page["status"], f"usage shown ({page['status']!r})")

        shot = os.environ.get("SPARSEMLA_SCREENSHOT")
        if shot:
            data = dt.call("Page.captureScreenshot", {"format": "png"})["data"]
            with open(shot, "wb") as f:
                f.write(base64.b64decode(data))
    finally:
        dt.close()
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(user_dir, ignore_errors=True)

    print("all checks passed" if not failures else f"{len(failures)} checks failed: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
