// A user's own workflow in the dashboard, in a real browser (Debian's headless Chromium driven by
// playwright-core), against a service that embeds the user's code (auth mode none).
//
//   node tests/browser/user_run.mjs <base-url> <workflow> <run-id> <step,step,...> <artifact-dir>
//
// Opens the runs list filtered by the workflow, clicks the run, and checks that its page shows
// it completed with every one of its steps in the timeline; saves <artifact-dir>/user-run.png.
// Prints one JSON line; exits non-zero on any failure (after saving <artifact-dir>/failure.png).
// Started by crates/tidemark/tests/embedded.rs.

import { mkdirSync } from "node:fs";
import { join, resolve } from "node:path";
import { launch } from "./chromium.mjs";

const [base, workflow, runId, stepList, artifactArg] = process.argv.slice(2);
if (!base || !workflow || !runId || !stepList || !artifactArg) {
  console.error("usage: node user_run.mjs <base-url> <workflow> <run-id> <step,step,...> <artifact-dir>");
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
  await page.goto(`${base}/ui/runs?workflow=${encodeURIComponent(workflow)}`);
  await page.waitForSelector("h1:text('Runs')");
  const options = await page.locator("datalist#workflows option").evaluateAll((o) => o.map((x) => x.value));
  check(options.includes(workflow), `the workflow filter offers ${JSON.stringify(options)}, not ${workflow}`);
  steps.push("listed");
  await Promise.all([
    page.waitForURL(`${base}/ui/runs/${encodeURIComponent(runId)}`),
    page.click(`a[href="/ui/runs/${runId}"]`),
  ]);
  const status = await page.locator(".run-head .badge").first().innerText();
  check(status === "completed", `the run page shows status ${status}, expected completed`);
  const timeline = await page.locator("ol.timeline").innerText();
  for (const step of stepList.split(",")) {
    check(timeline.includes(step), `the timeline does not show step ${step}: ${timeline}`);
  }
  const screenshot = join(artifacts, "user-run.png");
  await page.screenshot({ path: screenshot, fullPage: true });
  steps.push("run_page");
  console.log(JSON.stringify({ outcome: "ok", steps, screenshot }));
} catch (error) {
  await page.screenshot({ path: join(artifacts, "failure.png"), fullPage: true }).catch(() => {});
  console.log(JSON.stringify({ outcome: "failed", steps, error: String(error), url: page.url() }));
  process.exitCode = 1;
} finally {
  await close();
}
