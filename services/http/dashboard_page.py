"""The operator dashboard's HTML, CSS and script: Jinja2 templates rendered on the server, nothing to build.

Every value a template shows goes through Jinja2's autoescaping (prompts, tenant names, URLs and errors are user
data). Each live section is its own template, rendered into the page at first and then, once a second, into
/dashboard/state.json, whose script swaps a section in only when its HTML changed. The script and the stylesheet
are constants here, served inline under a per-response CSP nonce (no inline handlers, no external files).
"""

from __future__ import annotations

from datetime import UTC, datetime

from jinja2 import DictLoader, Environment, StrictUndefined, select_autoescape

SECTIONS = ("summary", "queue", "workers", "running", "waiting", "recent", "failures", "dead", "webhooks")

STYLE = """
:root { --fg: #161616; --muted: #474747; --line: #c6c6c6; --bg: #ffffff; --panel: #f4f4f4; --accent: #0b57d0;
        --focus: #b45309; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
        background: var(--bg); }
body { margin: 0; }
img.preview { display: block; max-height: 3rem; max-width: 16rem; }
.skip { position: absolute; left: -999px; top: 0; }
.skip:focus { left: 0.5rem; top: 0.5rem; background: var(--bg); padding: 0.5rem; z-index: 2; }
header { display: flex; gap: 1rem; align-items: center; justify-content: space-between; padding: 0.5rem 1rem;
         background: #1f2937; color: #ffffff; }
header h1 { font-size: 1.15rem; margin: 0; }
header p { margin: 0; }
header button { background: #ffffff; color: #1f2937; border-color: #ffffff; }
main { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 0.75rem; padding: 0.75rem 1rem 2rem; }
section { background: var(--panel); border: 1px solid var(--line); border-radius: 4px; padding: 0.5rem 0.75rem;
          min-width: 0; }
section.wide { grid-column: 1 / -1; }
@media (max-width: 60rem) { main { grid-template-columns: minmax(0, 1fr); } }
h2 { font-size: 1rem; margin: 0 0 0.35rem; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; width: 100%; background: var(--bg); }
caption { text-align: left; color: var(--muted); padding: 0 0 0.25rem; caption-side: top; }
th, td { border-bottom: 1px solid var(--line); padding: 0.2rem 0.4rem; text-align: left; vertical-align: top; }
th, td { white-space: nowrap; }
thead th { font-weight: 600; background: #e8e8e8; }
tbody th { font-weight: 400; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.wrap { white-space: normal; overflow-wrap: anywhere; min-width: 10rem; max-width: 24rem; }
code { font: 0.85rem ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.empty { color: var(--muted); font-style: italic; }
.note { color: var(--muted); margin: 0.25rem 0 0; font-size: 0.85rem; }
.tiles { display: flex; flex-wrap: wrap; gap: 0.5rem 1.5rem; margin: 0; }
.tiles div { display: flex; flex-direction: column; }
.tiles dt { color: var(--muted); font-size: 0.85rem; }
.tiles dd { margin: 0; font-size: 1.1rem; font-weight: 600; font-variant-numeric: tabular-nums; }
.status { display: inline-block; padding: 0 0.35rem; border-radius: 3px; font-weight: 600; font-size: 0.8rem;
          border: 1px solid currentColor; }
.s-CREATED, .s-QUEUED { color: #6b4e00; background: #fff6d6; }
.s-PROCESSING { color: #0b4a8b; background: #e6f0ff; }
.s-SUCCEEDED, .s-DELIVERED, .s-alive { color: #0a5c2b; background: #e3f4e8; }
.s-FAILED, .s-TIMEOUT, .s-lost { color: #8b1111; background: #fdeaea; }
.s-CANCELED, .s-draining, .s-PENDING { color: #3d3d3d; background: #ececec; }
button { font: inherit; padding: 0.15rem 0.6rem; border-radius: 4px; border: 1px solid var(--accent);
         background: var(--accent); color: #ffffff; cursor: pointer; }
button.secondary { background: var(--bg); color: var(--accent); }
:focus-visible { outline: 3px solid var(--focus); outline-offset: 2px; }
a { color: #0645ad; }
progress, meter { width: 6rem; vertical-align: middle; }
#banner { margin: 0.75rem 1rem 0; padding: 0.5rem 0.75rem; border: 2px solid #8b1111; color: #8b1111;
          background: #fdeaea; font-weight: 600; }
#notice { margin: 0.5rem 1rem 0; min-height: 1.4em; }
#notice.bad { color: #8b1111; font-weight: 600; }
#notice.good { color: #0a5c2b; font-weight: 600; }
dialog { border: 2px solid #1f2937; border-radius: 6px; max-width: 32rem; }
dialog::backdrop { background: rgb(0 0 0 / 45%); }
dialog h2 { font-size: 1.05rem; }
dialog menu { display: flex; gap: 0.5rem; justify-content: flex-end; padding: 0; margin: 1rem 0 0; }
.login { max-width: 26rem; margin: 4rem auto; background: var(--panel); border: 1px solid var(--line); padding: 1.5rem;
         border-radius: 6px; }
.login label { display: block; font-weight: 600; margin-bottom: 0.25rem; }
.login input { font: inherit; width: 100%; box-sizing: border-box; padding: 0.35rem; border: 1px solid #6b6b6b;
               border-radius: 4px; margin-bottom: 0.75rem; }
.error { color: #8b1111; font-weight: 600; }
"""

# Polls /dashboard/state.json while the tab is visible and swaps in the sections whose HTML changed (focus kept on
# the control that had it); actions ask in a modal <dialog>, then POST JSON with the session's CSRF token.
SCRIPT = """
(() => {
  "use strict";
  const POLL_MS = 1000;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const banner = document.getElementById("banner");
  const notice = document.getElementById("notice");
  const updated = document.getElementById("updated");
  const dialog = document.getElementById("confirm");
  const seen = new Map();
  let timer = null;
  let inflight = null;
  let pending = null;

  const alarm = (text) => { banner.textContent = text; banner.hidden = false; };
  const say = (text, good) => { notice.textContent = text; notice.className = good ? "good" : "bad"; };

  function swap(name, html) {
    const region = document.getElementById("section-" + name);
    if (!region || seen.get(name) === html) return;
    seen.set(name, html);
    const active = document.activeElement;
    const focused = active && active.id && region.contains(active) ? active.id : null;
    region.innerHTML = html;  // the server's autoescaped rendering
    if (focused) document.getElementById(focused)?.focus();
  }

  async function pull() {
    const answer = await fetch("/dashboard/state.json", {headers: {"Accept": "application/json"}, cache: "no-store"});
    if (answer.status === 401) { window.location.assign("/dashboard"); return; }
    const body = await answer.json().catch(() => ({}));
    if (!answer.ok) { alarm(body.error || ("The dashboard could not refresh: HTTP " + answer.status)); return; }
    banner.hidden = true;
    for (const [name, html] of Object.entries(body.sections)) swap(name, html);
    updated.textContent = body.updated;
    updated.dateTime = body.updated_at;
  }

  function refresh() {
    if (!inflight) {
      inflight = pull().catch((err) => alarm("The dashboard cannot reach its server: " + err.message))
                       .finally(() => { inflight = null; });
    }
    return inflight;
  }

  function schedule() {
    clearInterval(timer);
    timer = null;
    if (document.visibilityState !== "hidden") { timer = setInterval(refresh, POLL_MS); refresh(); }
  }

  document.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    pending = {action: button.dataset.action, task: button.dataset.task, field: button.dataset.field || "task_id",
               opener: button.id};
    document.getElementById("confirm-title").textContent = button.dataset.title;
    document.getElementById("confirm-text").textContent = button.dataset.confirm;
    document.getElementById("confirm-ok").textContent = button.dataset.verb;
    dialog.returnValue = "";
    dialog.showModal();
  });

  dialog.addEventListener("close", async () => {
    const chosen = pending;
    pending = null;
    if (!chosen) return;
    if (dialog.returnValue !== "confirm") { document.getElementById(chosen.opener)?.focus(); return; }
    say("Sending\\u2026", true);
    try {
      const answer = await fetch("/dashboard/actions/" + chosen.action, {
        method: "POST", headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf},
        body: JSON.stringify({[chosen.field]: chosen.task}),
      });
      if (answer.status === 401) { window.location.assign("/dashboard"); return; }
      const body = await answer.json().catch(() => ({message: "HTTP " + answer.status}));
      say(body.message || ("HTTP " + answer.status), answer.ok && body.ok);
    } catch (err) {
      say("The action could not be sent: " + err.message, false);
    }
    await refresh();
    document.getElementById(chosen.opener)?.focus();
  });

  document.addEventListener("visibilitychange", schedule);
  schedule();
})();
"""

_LAYOUT = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
{% block meta %}{% endblock %}
<title>{% block title %}{% endblock %} · taskgate</title>
<style nonce="{{ nonce }}">{{ style|safe }}</style>
</head>
<body>
{% block body %}{% endblock %}
</body>
</html>
"""

_LOGIN = """{% extends "layout.html" %}
{% block title %}Operator sign-in{% endblock %}
{% block body %}
<main class="login">
  <h1>taskgate operator dashboard</h1>
  {% if reason %}<p class="error" role="alert" id="login-error">{{ reason }}</p>{% endif %}
  <form method="post" action="/dashboard/login">
    <label for="key">Admin API key</label>
    <input id="key" name="key" type="password" autocomplete="off" spellcheck="false" required autofocus
           {% if reason %}aria-describedby="login-error" aria-invalid="true"{% endif %}>
    <button type="submit">Sign in</button>
  </form>
  <p class="note">Only an admin key opens the dashboard; the session lasts at most {{ hours }} hours.</p>
</main>
{% endblock %}
"""

# aria-live: the sections that change when something happens (a task arrives or ends, a dead letter, a failing
# webhook) are polite live regions; the overview (the oldest queued age), the workers (heartbeats) and the running
# tasks (progress) change every second or two and stay quiet, or a screen reader would never stop talking.
_PAGE = """{% extends "layout.html" %}
{% block meta %}<meta name="csrf-token" content="{{ csrf }}">{% endblock %}
{% block title %}Operator dashboard{% endblock %}
{% block body %}
<a class="skip" href="#main">Skip to the dashboard</a>
<header>
  <h1>taskgate operator dashboard</h1>
  <p>Updated <time id="updated" datetime="{{ view.at|iso }}">{{ view.at|clock }}</time> UTC, every second</p>
  {% if not operator %}<p id="read-only">Read-only key: no actions</p>{% endif %}
  <form method="post" action="/dashboard/logout">
    <input type="hidden" name="csrf" value="{{ csrf }}">
    <button type="submit">Sign out</button>
  </form>
</header>
<div id="banner" role="alert" {% if not problem %}hidden{% endif %}>{{ problem or "" }}</div>
<p id="notice" role="status" aria-live="polite"></p>
<main id="main" tabindex="-1">
  <section class="wide" aria-labelledby="h-summary"><h2 id="h-summary">Overview</h2>
    <div id="section-summary" aria-live="off">{% include "summary.html" %}</div></section>
  <section aria-labelledby="h-queue"><h2 id="h-queue">Queue depth</h2>
    <div id="section-queue" aria-live="polite">{% include "queue.html" %}</div></section>
  <section aria-labelledby="h-workers"><h2 id="h-workers">Workers</h2>
    <div id="section-workers" aria-live="off">{% include "workers.html" %}</div></section>
  <section class="wide" aria-labelledby="h-running"><h2 id="h-running">Running tasks</h2>
    <div id="section-running" aria-live="off">{% include "running.html" %}</div></section>
  <section aria-labelledby="h-waiting"><h2 id="h-waiting">Waiting tasks</h2>
    <div id="section-waiting" aria-live="polite">{% include "waiting.html" %}</div></section>
  <section aria-labelledby="h-recent"><h2 id="h-recent">Recently finished</h2>
    <div id="section-recent" aria-live="polite">{% include "recent.html" %}</div></section>
  <section class="wide" aria-labelledby="h-failures"><h2 id="h-failures">Recent failures</h2>
    <div id="section-failures" aria-live="polite">{% include "failures.html" %}</div></section>
  <section class="wide" aria-labelledby="h-dead"><h2 id="h-dead">Dead letters</h2>
    <div id="section-dead" aria-live="polite">{% include "dead.html" %}</div></section>
  <section class="wide" aria-labelledby="h-webhooks"><h2 id="h-webhooks">Failing webhook deliveries</h2>
    <div id="section-webhooks" aria-live="polite">{% include "webhooks.html" %}</div></section>
</main>
<dialog id="confirm" aria-labelledby="confirm-title" aria-describedby="confirm-text">
  <form method="dialog">
    <h2 id="confirm-title">Confirm</h2>
    <p id="confirm-text"></p>
    <menu>
      <button type="submit" value="cancel" class="secondary" autofocus>Cancel</button>
      <button type="submit" value="confirm" id="confirm-ok">Confirm</button>
    </menu>
  </form>
</dialog>
<script nonce="{{ nonce }}">{{ script|safe }}</script>
{% endblock %}
"""

_STATUS = '<span class="status s-{{ s }}">{{ s }}</span>'

_SECTION_TEMPLATES = {
    "summary.html": """<dl class="tiles">
  <div><dt>Running</dt><dd>{{ view.running }} of {{ view.capacity }} slots</dd></div>
  <div><dt>Waiting</dt><dd>{{ view.waiting_total }}</dd></div>
  <div><dt>Oldest queued</dt><dd>{{ view.oldest_queued }}</dd></div>
  <div><dt>Live workers</dt><dd>{{ view.live_workers }} of {{ view.workers|length }}</dd></div>
  <div><dt>Dead letters not replayed</dt><dd>{{ view.dead_open }}</dd></div>
  {% for name, count in view.callbacks %}<div><dt>Webhooks {{ name|lower }}</dt><dd>{{ count }}</dd></div>{% endfor %}
</dl>""",
    "queue.html": """<div class="scroll"><table>
<caption>Unfinished tasks per model and priority</caption>
<thead><tr><th scope="col">Model</th><th scope="col">Priority</th><th scope="col" class="num">Created</th>
<th scope="col" class="num">Queued</th><th scope="col" class="num">Running</th></tr></thead>
<tbody>
{% for q in view.queue %}<tr data-model="{{ q.model }}" data-priority="{{ q.priority }}">
<th scope="row">{{ q.model }}</th><td>{{ q.priority }}</td><td class="num">{{ q.created }}</td>
<td class="num">{{ q.queued }}</td><td class="num">{{ q.running }}</td></tr>
{% else %}<tr><td colspan="5" class="empty">Nothing waiting or running.</td></tr>{% endfor %}
</tbody></table></div>""",
    "workers.html": """<div class="scroll"><table>
<caption>Registered workers; busy = slots running a task</caption>
<thead><tr><th scope="col">Worker</th><th scope="col">State</th><th scope="col">Device</th>
<th scope="col">Busy slots</th><th scope="col">Last heartbeat</th><th scope="col">Action</th></tr></thead>
<tbody>
{% for w in view.workers %}<tr data-worker="{{ w.id }}">
<th scope="row"><code>{{ w.id }}</code></th>
<td>{% for s in w.states %}{{ status(s) }} {% endfor %}</td>
<td>{{ w.device or "—" }}</td>
<td><meter min="0" max="{{ [w.slots, 1]|max }}" value="{{ w.running }}" aria-label="Busy slots of {{ w.id }}"></meter>
{{ w.running }} of {{ w.slots }}</td>
<td>{{ when(w.last_heartbeat) }}</td>
<td>{% if w.can_drain and operator %}<button type="button" id="drain-{{ w.id }}" data-action="drain" data-field="worker_id"
  data-task="{{ w.id }}" data-title="Drain a worker" data-verb="Drain"
  data-confirm="Drain worker {{ w.id }}? It takes no new task, lets what it runs finish (up to its drain grace),
 then stops; the queue waits for the other workers."
  aria-label="Drain worker {{ w.id }}">Drain</button>{% else %}—{% endif %}</td></tr>
{% else %}<tr><td colspan="6" class="empty">No worker has registered.</td></tr>{% endfor %}
</tbody></table></div>
<p class="note">The device-busy fraction of each GPU is the worker's
<code>taskgate_worker_device_busy_seconds_total</code> metric; the registry holds slots, not device time.</p>""",  # noqa: E501
    "running.html": """<div class="scroll"><table>
<caption>Tasks PROCESSING, by worker{% if view.running_more %} (the first {{ view.running_tasks|length }}){% endif %}</caption>
<thead><tr><th scope="col">Task</th><th scope="col">Worker</th><th scope="col">Tenant</th><th scope="col">Model</th>
<th scope="col" class="num">Attempt</th><th scope="col">Progress</th><th scope="col">Started</th>
<th scope="col">Prompt</th><th scope="col">Preview</th></tr></thead>
<tbody>
{% for t in view.running_tasks %}<tr id="task-{{ t.id }}" data-task-id="{{ t.id }}" data-status="{{ t.status }}">
<th scope="row"><code>{{ t.id }}</code>{{ replay_of(t) }}</th><td><code>{{ t.worker or "—" }}</code></td>
<td>{{ t.tenant }}</td><td>{{ t.model }}</td><td class="num">{{ t.attempt }}</td>
<td><progress max="100" value="{{ t.progress }}" aria-label="Progress of task {{ t.id }}"></progress> {{ t.progress }}%</td>
<td>{{ when(t.started) }}</td><td class="wrap">{{ t.prompt|clip(80) }}</td>
<td>{% if t.model in previews and t.progress > 0 %}<img class="preview" src="/dashboard/tasks/{{ t.id }}/preview?at={{ t.progress }}"
 alt="Newest preview of task {{ t.id }}" loading="lazy">{% else %}—{% endif %}</td></tr>
{% else %}<tr><td colspan="9" class="empty">No task is running.</td></tr>{% endfor %}
</tbody></table></div>""",  # noqa: E501
    "waiting.html": """<div class="scroll"><table>
<caption>CREATED and QUEUED tasks, least recently updated first
{%- if view.waiting_more %} (the first {{ view.waiting|length }}){% endif %}</caption>
<thead><tr><th scope="col">Task</th><th scope="col">Status</th><th scope="col">Model</th><th scope="col">Priority</th>
<th scope="col">Tenant</th><th scope="col">Since</th><th scope="col">Prompt</th></tr></thead>
<tbody>
{% for t in view.waiting %}<tr id="task-{{ t.id }}" data-task-id="{{ t.id }}" data-status="{{ t.status }}">
<th scope="row"><code>{{ t.id }}</code>{{ replay_of(t) }}</th><td>{{ status(t.status) }}</td><td>{{ t.model }}</td>
<td>{{ t.priority }}</td><td>{{ t.tenant }}</td><td>{{ when(t.updated) }}</td><td class="wrap">{{ t.prompt|clip(60) }}</td></tr>
{% else %}<tr><td colspan="7" class="empty">No task is waiting.</td></tr>{% endfor %}
</tbody></table></div>""",  # noqa: E501
    "recent.html": """<div class="scroll"><table>
<caption>The latest finished tasks, newest first</caption>
<thead><tr><th scope="col">Task</th><th scope="col">Status</th><th scope="col">Model</th><th scope="col">Tenant</th>
<th scope="col">Finished</th></tr></thead>
<tbody>
{% for t in view.recent %}<tr id="task-{{ t.id }}" data-task-id="{{ t.id }}" data-status="{{ t.status }}">
<th scope="row"><code>{{ t.id }}</code>{{ replay_of(t) }}</th><td>{{ status(t.status) }}</td><td>{{ t.model }}</td>
<td>{{ t.tenant }}</td><td>{{ when(t.finished) }}</td></tr>
{% else %}<tr><td colspan="5" class="empty">No task has finished yet.</td></tr>{% endfor %}
</tbody></table></div>""",
    "failures.html": """<div class="scroll"><table>
<caption>FAILED and TIMEOUT tasks, newest first; a replay runs the stored request again as a new task</caption>
<thead><tr><th scope="col">Task</th><th scope="col">Status</th><th scope="col">Model</th><th scope="col">Tenant</th>
<th scope="col">Error</th><th scope="col">Finished</th><th scope="col">Action</th></tr></thead>
<tbody>
{% for t in view.failures %}<tr data-failed-id="{{ t.id }}">
<th scope="row"><code>{{ t.id }}</code></th><td>{{ status(t.status) }}</td><td>{{ t.model }}</td><td>{{ t.tenant }}</td>
<td class="wrap"><code>{{ t.error_code }}</code> {{ t.error_message|clip(160) }}</td><td>{{ when(t.finished) }}</td>
<td>{{ replay_cell(t.id, t.tenant, t.model, view.replays.get(t.id), none, "failures") }}</td></tr>
{% else %}<tr><td colspan="7" class="empty">No recent failure.</td></tr>{% endfor %}
</tbody></table></div>""",
    "dead.html": """<div class="scroll"><table>
<caption>Tasks failed for good (retries exhausted, timed out, worker lost), newest first</caption>
<thead><tr><th scope="col">Task</th><th scope="col">Model</th><th scope="col">Tenant</th><th scope="col">Reason</th>
<th scope="col">Last error</th><th scope="col">Dead since</th><th scope="col">Replay</th></tr></thead>
<tbody>
{% for d in view.dead %}<tr data-dead-id="{{ d.task.id }}">
<th scope="row"><code>{{ d.task.id }}</code></th><td>{{ d.task.model }}</td><td>{{ d.task.tenant }}</td><td>{{ d.reason }}</td>
<td class="wrap"><code>{{ d.task.error_code }}</code> {{ d.task.error_message|clip(160) }}</td><td>{{ when(d.dead_at) }}</td>
<td>{{ replay_cell(d.task.id, d.task.tenant, d.task.model, d.replayed_as, d.replayed_at, "dead") }}</td></tr>
{% else %}<tr><td colspan="7" class="empty">No dead letters.</td></tr>{% endfor %}
</tbody></table></div>""",  # noqa: E501
    "webhooks.html": """<div class="scroll"><table>
<caption>Deliveries that gave up (FAILED) or whose last attempt failed (PENDING a retry), newest first</caption>
<thead><tr><th scope="col">Task</th><th scope="col">State</th><th scope="col">Tenant</th><th scope="col">Event</th>
<th scope="col">URL</th><th scope="col" class="num">Attempts</th><th scope="col">Last answer</th>
<th scope="col">Last attempt</th><th scope="col">Action</th></tr></thead>
<tbody>
{% for d in view.webhooks %}<tr data-delivery-id="{{ d.id }}">
<th scope="row"><code>{{ d.task_id }}</code></th><td>{{ status(d.status) }}</td><td>{{ d.tenant }}</td><td>{{ d.event }}</td>
<td class="wrap">{{ d.url|clip(80) }}</td><td class="num">{{ d.attempts }}</td>
<td class="wrap">{% if d.last_error %}{{ d.last_error|clip(120) }}{% elif d.last_status_code %}HTTP {{ d.last_status_code }}
{%- else %}—{% endif %}</td>
<td>{{ when(d.last_attempt) }}</td>
<td>{% if operator %}<button type="button" id="redeliver-{{ d.id }}" data-action="redeliver" data-task="{{ d.task_id }}"
  data-title="Redeliver webhooks" data-verb="Redeliver"
  data-confirm="Send task {{ d.task_id }}'s terminal webhooks to {{ d.tenant }}'s receiver again,
 with the same webhook ids and a fresh retry schedule?"
  aria-label="Redeliver the webhooks of task {{ d.task_id }}">Redeliver</button>{% else %}—{% endif %}</td></tr>
{% else %}<tr><td colspan="9" class="empty">No failing delivery.</td></tr>{% endfor %}
</tbody></table></div>""",  # noqa: E501
}

_MACROS = """{% macro status(s) %}""" + _STATUS + """{% endmacro %}
{% macro when(t) %}{% if t %}<time datetime="{{ t|iso }}">{{ t|clock }}</time>{% else %}—{% endif %}{% endmacro %}
{% macro replay_of(t) %}{% if t.replay_of %}<br><small>replay of <code>{{ t.replay_of }}</code></small>{% endif %}{% endmacro %}
{% macro replay_cell(task_id, tenant, model, replayed_as, replayed_at, where) %}
{%- if replayed_as -%}
<span data-replayed-as="{{ replayed_as }}">Replayed as <a href="#task-{{ replayed_as }}">{{ replayed_as }}</a>
{%- if replayed_at %} at {{ when(replayed_at) }}{% endif %}</span>
{%- elif operator -%}
<button type="button" id="replay-{{ where }}-{{ task_id }}" data-action="replay" data-task="{{ task_id }}"
  data-title="Replay a failed task" data-verb="Replay"
  data-confirm="Replay task {{ task_id }} ({{ tenant }}, {{ model }}) as a new task? It runs the stored request
 again, seed included, past the tenant's rate and pending limits."
  aria-label="Replay task {{ task_id }}">Replay</button>
{%- else -%}
—
{%- endif -%}
{% endmacro %}
"""  # noqa: E501


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def clock(moment: datetime) -> str:
    """Time of day in UTC; the date too when it is not today's (UTC)."""
    moment = moment.astimezone(UTC)
    if moment.date() == datetime.now(UTC).date():
        return moment.strftime("%H:%M:%S")
    return moment.strftime("%Y-%m-%d %H:%M")


def _clip(value: str, limit: int) -> str:
    """At most `limit` characters, an ellipsis marking a cut (escaping happens after, on the whole string)."""
    return value if len(value) <= limit else value[: limit - 1] + "…"


def environment() -> Environment:
    """The dashboard's Jinja2 environment: every template, autoescaping on, unknown names an error."""
    macros_first = {name: "{% from 'macros.html' import status, when, replay_of, replay_cell with context %}" + source
                    for name, source in _SECTION_TEMPLATES.items()}
    env = Environment(
        loader=DictLoader(
            {"layout.html": _LAYOUT, "login.html": _LOGIN, "page.html": _PAGE, "macros.html": _MACROS, **macros_first}
        ),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(iso=iso, clock=clock, clip=_clip)
    # constants of this module, marked safe where the page uses them
    env.globals.update(style=STYLE, script=SCRIPT, previews=frozenset())
    return env
