#!/usr/bin/python3
"""What a page rendered by headless Chromium looks like, for tests/lib/test_report.cpp.

usage: render_check.py CHROMIUM PAGE.html WIDTH WORKDIR

Renders PAGE at WIDTH CSS pixels twice, in an iframe of that width (headless Chromium lays a
top-level page out at least 500 px wide): once a copy with a probe script appended (its layout,
read back with --dump-dom), once the page itself as a screenshot (device scale 1, as tall as
the page). Prints one JSON object: "problems", a list of what is wrong (empty when nothing is),
and "measured", the figures they were read from:
  - blank: under 2% of the screenshot's pixels differ from its top-left pixel;
  - unstyled: the figures (chart cards) have no background, so the stylesheet did not apply;
  - a chart (its SVG's box: the legend is outside it) holds fewer than 100 drawn pixels (strongly
    coloured: the series; the grid, ticks and axis titles are grey);
  - overflow: the page is wider than the viewport, or an element (outside a box that scrolls
    sideways, such as the tables') reaches past its right edge.
Exit 0 with the JSON; 1 when Chromium fails.
"""
import json
import os
import re
import struct
import subprocess
import sys
import zlib

PROBE = r"""
<script>
(function () {
  const vw = window.innerWidth, out = {viewport: vw, scroll_width: document.documentElement.scrollWidth,
                                      scroll_height: document.documentElement.scrollHeight, charts: [], overflow: []};
  const fig = document.querySelector('figure');
  out.figure_background = fig ? getComputedStyle(fig).backgroundColor : null;
  function scrolls(e) {
    for (let p = e.parentElement; p; p = p.parentElement) {
      const o = getComputedStyle(p).overflowX;
      if (o === 'auto' || o === 'scroll' || o === 'hidden') return true;
    }
    return false;
  }
  for (const e of document.body.querySelectorAll('*')) {
    if (e.tagName === 'SCRIPT') continue;
    const r = e.getBoundingClientRect();
    if (r.width > 0 && r.right > vw + 0.5 && !scrolls(e))
      out.overflow.push(e.tagName.toLowerCase() + (e.className && e.className.baseVal === undefined ? '.' + e.className : '') +
                        ' reaches x ' + Math.round(r.right));
  }
  for (const svg of document.querySelectorAll('figure svg[role=img]')) {
    const r = svg.getBoundingClientRect();
    out.charts.push({title: svg.getAttribute('aria-label'), plot: [r.left + scrollX, r.top + scrollY, r.right + scrollX, r.bottom + scrollY]});
  }
  parent.document.getElementById('ek-probe-out').textContent = JSON.stringify(out);
})();
</script>
"""


def chromium(binary, args):
    r = subprocess.run(["timeout", "120", binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--force-device-scale-factor=1"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.stderr.write(f"render_check: chromium exited {r.returncode}: {r.stderr[-2000:]}\n")
        sys.exit(1)
    return r.stdout


def read_png(path):
    """(width, height, rows of (r, g, b) tuples) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"render_check: {path}: not a PNG")
    pos, idat, w = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or color not in (2, 6) or interlace:
                raise SystemExit(f"render_check: {path}: depth {depth}, colour type {color}, interlace {interlace}")
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, rows, prev = zlib.decompress(idat), w * bpp, [], bytearray(w * bpp)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(w)])
        prev = line
    return w, h, rows


def wrapper(page_html, width, height, probe):
    """The page in an iframe WIDTH px wide (srcdoc: the same origin as the wrapper). Headless
    Chromium lays a top-level page out at least 500 px wide whatever --window-size says, so a
    phone width needs the frame. With `probe`, the page's copy carries the probe script, which
    writes its JSON into the wrapper's <pre id="ek-probe-out">."""
    if probe:
        page_html = page_html.replace("</body>", PROBE + "</body>") if "</body>" in page_html else page_html + PROBE
    doc = page_html.replace("&", "&amp;").replace('"', "&quot;")
    return ('<!doctype html><html><head><meta charset="utf-8"></head><body style="margin:0;background:#fff">'
            '<pre id="ek-probe-out" style="display:none"></pre>'
            f'<iframe style="display:block;border:0;width:{width}px;height:{height}px" srcdoc="{doc}"></iframe>'
            '</body></html>')


def main():
    binary, page, width, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), os.path.abspath(sys.argv[4])
    os.makedirs(work, exist_ok=True)
    html = open(page, encoding="utf-8").read()
    probe_page = os.path.join(work, f"probe-{width}.html")
    with open(probe_page, "w", encoding="utf-8") as f:
        f.write(wrapper(html, width, 1600, True))
    dom = chromium(binary, [f"--window-size={max(width, 500)},1600", "--dump-dom", "file://" + probe_page])
    m = re.search(r'<pre id="ek-probe-out"[^>]*>(.*?)</pre>', dom, re.S)
    if not m or not m.group(1):
        raise SystemExit("render_check: the probe wrote nothing (did the page's script run?)")
    layout = json.loads(m.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"'))
    height = max(400, int(layout["scroll_height"]))
    shot_page = os.path.join(work, f"shot-{width}.html")
    with open(shot_page, "w", encoding="utf-8") as f:
        f.write(wrapper(html, width, height, False))
    png = os.path.join(work, f"shot-{width}.png")
    chromium(binary, [f"--window-size={max(width, 500)},{height}", f"--screenshot={png}", "file://" + shot_page])
    w, h, px = read_png(png)
    w = min(w, width)  # the frame: what lies right of it is the wrapper's
    problems = []
    bg = px[0][0]
    differ = sum(1 for row in px for p in row if p != bg)
    if differ < 0.02 * w * h:
        problems.append(f"blank: {differ} of {w * h} pixels differ from the background")
    if layout["figure_background"] in (None, "rgba(0, 0, 0, 0)", "transparent"):
        problems.append(f"unstyled: the chart cards have no background ({layout['figure_background']}): "
                        "the stylesheet did not apply")
    charts = []
    for c in layout["charts"]:
        x0, y0, x1, y1 = (int(round(v)) for v in c["plot"])
        drawn = 0
        for y in range(max(0, y0), min(h, y1 + 1)):
            for x in range(max(0, x0), min(w, x1 + 1)):
                r, g, b = px[y][x]
                drawn += max(r, g, b) - min(r, g, b) > 60
        charts.append({"title": c["title"], "plot": [x0, y0, x1, y1], "drawn_pixels": drawn})
        if x1 <= x0 or y1 <= y0 or drawn < 100:
            problems.append(f"chart '{c['title']}': its plot area {[x0, y0, x1, y1]} holds {drawn} drawn pixels")
    if not layout["charts"]:
        problems.append("no chart on the page")
    if layout["scroll_width"] > layout["viewport"]:
        problems.append(f"overflow: the page is {layout['scroll_width']} px wide in a {layout['viewport']} px viewport")
    if layout["overflow"]:
        problems.append(f"overflow: {len(layout['overflow'])} elements reach past the viewport's right edge, first "
                        + "; ".join(layout["overflow"][:3]))
    print(json.dumps({"problems": problems, "measured": {
        "screenshot": [w, h], "pixels_off_background": differ, "viewport": layout["viewport"],
        "scroll_width": layout["scroll_width"], "figure_background": layout["figure_background"], "charts": charts}}))


if __name__ == "__main__":
    main()
