// Debian's headless Chromium for the browser tests, driven by playwright-core: a fresh profile
// every run, and flags that keep Chromium off the network (this machine's closed network
// otherwise stalls it) and out of first-run work. `close()` also removes the profile.

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

export async function launch() {
  const profile = mkdtempSync(join(tmpdir(), "tidemark-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: "/usr/bin/chromium",
    headless: true,
    viewport: { width: 1280, height: 900 },
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  context.setDefaultTimeout(30_000);
  const page = context.pages()[0] ?? (await context.newPage());
  async function close() {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
  }
  return { page, close };
}
