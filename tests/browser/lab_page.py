"""A notebook open in JupyterLab in Chromium, driven as a learner would (Playwright).

``NotebookPage.open`` loads one notebook in a workspace of its own (nothing else reopens),
waits for its kernel and installs a recorder on the kernel connection (through
``window.jupyterapp``, which lab_server exposes):

- every request the page sends (cell executions, widget comm messages) is pending until the
  kernel reports idle for it; ``settle`` waits for none pending, which is how the test knows
  the kernel has handled a click or a slider move, even when JupyterLab sends widget messages
  to a kernel subshell;
- every ``error`` message and every traceback on stderr the kernel publishes for something
  other than a cell is kept: an exception in a widget callback, which JupyterLab shows only in
  its log console, not under a cell.

``problems`` is the error detector: cell outputs of type error, tracebacks on stderr, errors
raised in widget callbacks, widgets that failed to render, and uncaught page errors. A warning
or other text on stderr without a traceback is not a problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lab_server import TOKEN
from playwright.sync_api import Page
from playwright.sync_api import TimeoutError as PlaywrightTimeout

KERNEL_DISPLAY_NAME = "Python 3 (paged-kv-course)"
TRACEBACK = "Traceback (most recent call last)"

# The NotebookPanel of the page (each page shows one notebook).
_PANEL = """() => {
  const app = window.jupyterapp;
  const panels = app ? [...app.shell.widgets('main')].filter(
    w => w.sessionContext && w.content && w.content.model) : [];
  return panels.length ? panels[0] : null;
}"""

_KERNEL_READY = f"""() => {{
  const panel = ({_PANEL})();
  const k = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle';
}}"""

_INSTALL_RECORDER = f"""() => {{
  const kernel = ({_PANEL})().sessionContext.session.kernel;
  const rec = window.__walk = {{pending: new Set(), callbackErrors: []}};
  const TRACKED = new Set(['execute_request', 'comm_msg', 'comm_open', 'comm_close',
                           'create_subshell_request']);
  kernel.anyMessage.connect((_, args) => {{
    const m = args.msg;
    if (args.direction === 'send') {{
      if (TRACKED.has(m.header.msg_type)) rec.pending.add(m.header.msg_id);
      return;
    }}
    if (m.channel !== 'iopub') return;
    const parent = m.parent_header || {{}};
    const t = m.header.msg_type;
    if (t === 'status' && m.content.execution_state === 'idle') rec.pending.delete(parent.msg_id);
    if (parent.msg_type === 'execute_request') return;   // a cell's: in its outputs
    if (t === 'error')
      rec.callbackErrors.push(parent.msg_type + ': ' + m.content.ename + ': ' + m.content.evalue);
    if (t === 'stream' && m.content.name === 'stderr' && m.content.text.includes({TRACEBACK!r}))
      rec.callbackErrors.push(parent.msg_type + ': traceback on stderr: '
                              + m.content.text.trim().split('\\n').slice(-1)[0]);
  }});
  return true;
}}"""

SETTLED = f"""() => {{
  const panel = ({_PANEL})();
  const k = panel.sessionContext.session.kernel;
  return window.__walk.pending.size === 0 && k.status === 'idle';
}}"""

# Run All has finished: no cell runs or waits ([*]), every request the page sent is answered.
_RUN_ALL_DONE = f"""() => {{
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-InputPrompt')];
  const running = ({_PANEL})().content.widgets.some(
    c => c.model.type === 'code' && c.model.executionState === 'running');
  return !running && !prompts.some(p => p.textContent.includes('[*]')) && ({SETTLED})();
}}"""

# Widget outputs in the cells' models, and how many of them the page has drawn (a widget, or
# ipywidgets' "Error displaying widget" text, which it shows once the model lookup gives up).
_WIDGET_OUTPUTS = f"""() => {{
  const panel = ({_PANEL})();
  let wanted = 0;
  panel.content.widgets.forEach(cell => {{
    if (cell.model.type !== 'code') return;
    const outputs = cell.model.outputs;
    for (let j = 0; j < outputs.length; j++)
      if ('application/vnd.jupyter.widget-view+json' in (outputs.get(j).data || {{}})) wanted++;
  }});
  const drawn = [...panel.node.querySelectorAll('.jp-OutputArea-output')].filter(
    o => !o.parentElement.closest('.jp-OutputArea-output')
      && (o.classList.contains('jupyter-widgets') || o.querySelector('.jupyter-widgets'))).length;
  return [wanted, drawn];
}}"""

# Problems the notebook shows: error outputs, stderr tracebacks, widgets that did not render.
_NOTEBOOK_PROBLEMS = f"""() => {{
  const panel = ({_PANEL})();
  const found = [];
  panel.content.widgets.forEach((cell, i) => {{
    if (cell.model.type !== 'code') return;
    const where = 'cell ' + (i + 1) + ' [' + (cell.model.executionCount ?? ' ') + ']';
    const outputs = cell.model.outputs;
    for (let j = 0; j < outputs.length; j++) {{
      const o = outputs.get(j).toJSON();
      if (o.output_type === 'error') found.push(where + ': ' + o.ename + ': ' + o.evalue);
      const text = [].concat(o.text || []).join('');
      if (o.output_type === 'stream' && o.name === 'stderr' && text.includes({TRACEBACK!r}))
        found.push(where + ': traceback on stderr: ' + text.trim().split('\\n').slice(-1)[0]);
    }}
    cell.node.querySelectorAll('.jp-OutputArea-output').forEach(out => {{
      const t = out.textContent.trim();
      if (out.querySelector('.jupyter-widgets-error-widget')
          || t.startsWith('Error displaying widget') || t.startsWith('Error creating widget'))
        found.push(where + ': widget failed to render: ' + t.slice(0, 120));
    }});
  }});
  return found;
}}"""


@dataclass
class NotebookPage:
    """One notebook open in its own browser page; create with ``NotebookPage.open``."""

    page: Page
    name: str
    page_errors: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, context, base: str, name: str, timeout_ms: int = 120_000) -> NotebookPage:
        """Open ``name`` (relative to the server's root) in a new page of ``context``; return
        once its kernel is connected and idle and the recorder is installed."""
        page = context.new_page()
        nb = cls(page, name)
        page.on("pageerror", lambda exc: nb.page_errors.append(str(exc)))
        workspace = "walk-" + "".join(c if c.isalnum() else "-" for c in name)
        page.goto(f"{base}/lab/workspaces/{workspace}/tree/{name}?token={TOKEN}")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)
        nb._choose_kernel_if_asked()
        page.wait_for_function(_KERNEL_READY, timeout=timeout_ms)
        page.evaluate(_INSTALL_RECORDER)
        return nb

    def _choose_kernel_if_asked(self) -> None:
        """Answer a "Select Kernel" dialog as a learner would (the course's kernel); the copies
        name it in their metadata, so normally no dialog comes."""
        dialog = self.page.locator(".jp-Dialog:has-text('Select Kernel')")
        if dialog.count():
            dialog.locator("select").select_option(label=KERNEL_DISPLAY_NAME)
            dialog.get_by_role("button", name="Select", exact=True).click()

    def run_all(self, timeout_ms: int) -> None:
        """Run > Run All Cells from the menu bar, then wait until every cell has run (or the
        run stopped at an error) and the kernel has answered everything."""
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        # The run has started once a cell is queued or numbered (the copies start with none).
        self.page.wait_for_function("""() => [...document.querySelectorAll(
            '.jp-Notebook .jp-InputPrompt')].some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))""")
        self.page.wait_for_function(_RUN_ALL_DONE, timeout=timeout_ms, polling=250)
        try:   # every widget output drawn (problems() reports those that never are)
            self.page.wait_for_function(f"() => {{ const [w, d] = ({_WIDGET_OUTPUTS})(); "
                                        "return w === d; }", timeout=60_000, polling=250)
        except PlaywrightTimeout:
            pass

    def settle(self, timeout_ms: int = 120_000) -> None:
        """Wait until the kernel has handled every message the page sent (clicks, slider moves)
        and reported idle for each."""
        self.page.wait_for_function(SETTLED, timeout=timeout_ms, polling=100)

    def problems(self) -> list[str]:
        """Everything that counts as an error so far (see the module docstring)."""
        found = list(self.page.evaluate(_NOTEBOOK_PROBLEMS))
        wanted, drawn = self.page.evaluate(_WIDGET_OUTPUTS)
        if drawn < wanted:
            found.append(f"{wanted - drawn} of {wanted} widget outputs were never drawn")
        found += [f"in a widget callback ({e})"
                  for e in self.page.evaluate("() => window.__walk.callbackErrors")]
        found += [f"page error: {e}" for e in self.page_errors]
        return found

    def cells_run(self) -> tuple[int, int]:
        """(code cells with an execution count, non-empty code cells): equal after a full run."""
        return tuple(self.page.evaluate(f"""() => {{
          const code = ({_PANEL})().content.widgets.filter(
            c => c.model.type === 'code' && c.model.sharedModel.getSource().trim());
          return [code.filter(c => c.model.executionCount != null).length, code.length];
        }}"""))
