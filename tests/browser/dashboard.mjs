// The dashboard in a real browser: Debian's headless Chromium driven by playwright-core.
//
//   node tests/browser/dashboard.mjs <base-url> <token> <parked-run-id> <artifact-dir>
//
// Logs in with the token (the login form sets the HttpOnly cookie), opens the overview and saves
// a screenshot (<artifact-dir>/dashboard.png), opens the parked run, clicks Retry and checks the
// page says the run was retried. Prints one JSON line; exits non-zero on any failure (after
// saving <artifact-dir>/failure.png). Started by crates/cli/tests/it/server_dashboard.rs.

import { mkdirSync } from "node:fs";
import { join, resolve } from "node:path";
import { launch } from "./chromium.mjs";

const [base, token, runId, artifactArg] = process.argv.slice(2);
if (!base || !token || !runId || !artifactArg) {
  console.error("usage: node dashboard.mjs <base-url> <token> <parked-run-id> <artifact-dir>");
  process.exit(2);
}
const artifacts = resolve(artifactArg);
mkdirSync(artifacts, { recursive: true });

const { page, close } = await launch();
const steps = [];

function check(condition, message) {
  if (!condition) throw new Error(message);
}

try {
  // Not logged in: the dashboard sends the browser to the login form.
  await page.goto(`${base}/ui`);
  check(new URL(page.url()).pathname === "/ui/login", `expected the login page, got ${page.url()}`);
  await page.fill("#token", token);
  await Promise.all([page.waitForURL(`${base}/ui`), page.click("button[type=submit]")]);
  steps.push("logged_in");

  // The overview: the tiles, and the parked run counted.
  await page.waitForSelector("h1:text('Overview')");
  const parkedTile = page.locator("a.tile", { hasText: "Parked / failed runs" });
  const parked = Number((await parkedTile.locator(".value").innerText()).replace(/,/g, ""));
  check(parked >= 1, `the overview counts ${parked} parked runs`);
  check((await page.locator("figure.chart svg").count()) === 4, "the overview has four charts");
  check((await page.evaluate(() => typeof window.htmx)) === "object", "the vendored htmx loaded");
  // Let the sampler (one sample every 2 s) draw a few points before the screenshot: reload,
  // at most 30 times, until the charts have 6 samples.
  for (let i = 0; i < 30; i++) {
    const scale = await page.locator("figure.chart .scale").first().innerText();
    if (Number(scale.match(/(\d+) samples/)?.[1] ?? 0) >= 6) break;
    await page.waitForTimeout(1000);
    await page.reload();
  }
  const screenshot = join(artifacts, "dashboard.png");
  await page.screenshot({ path: screenshot, fullPage: true });
  steps.push("overview");

  // The parked run's timeline, then Retry.
  await page.goto(`${base}/ui/runs/${encodeURIComponent(runId)}`);
  const status = await page.locator(".run-head .badge").first().innerText();
  check(status === "parked", `the run page shows status ${status}, expected parked`);
  await page.screenshot({ path: join(artifacts, "run.png"), fullPage: true });
  await Promise.all([
    page.waitForURL((url) => url.searchParams.get("done") === "retried"),
    page.locator("form[action$='/retry'] button").click(),
  ]);
  const banner = await page.locator("p.flash.good").innerText();
  check(banner.includes("Run retried"), `after Retry the page says ${JSON.stringify(banner)}`);
  const timeline = await page.locator("ol.timeline").innerText();
  check(timeline.includes("Operator: operator retry: retried from the dashboard"), "the timeline shows the retry");
  steps.push("retried");

  console.log(JSON.stringify({ outcome: "ok", steps, screenshot, after_retry: banner }));
} catch (error) {
  await page.screenshot({ path: join(artifacts, "failure.png"), fullPage: true }).catch(() => {});
  console.log(JSON.stringify({ outcome: "failed", steps, error: String(error), url: page.url() }));
  process.exitCode = 1;
} finally {
  await close();
}
