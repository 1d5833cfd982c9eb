package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// root is the repository root, seen from this package's directory.
const root = "../.."

// TestMarkdownLinksResolve checks that every relative link in README.md and
// docs/*.md names a file or directory of the repository. Anchors are not
// checked, and links with a scheme (https:, mailto:) are left alone: no
// network.
func TestMarkdownLinksResolve(t *testing.T) {
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) == 0 {
		t.Fatal("no docs/*.md found: the user documentation is missing")
	}
	files := append([]string{filepath.Join(root, "README.md")}, docs...)
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		name, _ := filepath.Rel(root, file)
		links := markdownLinks(string(text))
		if len(links) == 0 {
			t.Errorf("%s: no relative links found; the link parser is probably broken", name)
		}
		for _, l := range links {
			if problem := checkLink(root, filepath.Dir(file), l.target); problem != "" {
				t.Errorf("%s:%d: link %q %s", name, l.line, l.target, problem)
			}
		}
	}
}

// TestMarkdownLinksFindsBrokenLinks proves the check is not vacuous: it
// finds inline and reference links, ignores code, and reports a missing
// file and a link out of the repository.
func TestMarkdownLinksFindsBrokenLinks(t *testing.T) {
	text := strings.Join([]string{
		"See [the design](docs/missing.md#top) and [readme](README.md \"title\").",
		"Code `[not](a-link.md)` and a [web page](https://example.com/x.md).",
		"```",
		"[in a fence](fenced.md)",
		"```",
		"[ref]: ../outside.md",
		"[anchor](#what-it-guarantees)",
	}, "\n")
	var got []string
	for _, l := range markdownLinks(text) {
		got = append(got, l.target)
	}
	want := []string{"docs/missing.md#top", "README.md", "../outside.md"}
	if !slices.Equal(got, want) {
		t.Fatalf("links = %q, want %q", got, want)
	}
	if p := checkLink(root, root, "docs/missing.md#top"); !strings.Contains(p, "does not exist") {
		t.Errorf("missing file: problem %q, want it to say it does not exist", p)
	}
	if p := checkLink(root, root, "../outside.md"); !strings.Contains(p, "outside the repository") {
		t.Errorf("link out of the repository: problem %q", p)
	}
	if p := checkLink(root, root, "/README.md"); p == "" {
		t.Error("an absolute path was accepted")
	}
	if p := checkLink(root, root, "README.md#what-it-guarantees"); p != "" {
		t.Errorf("README.md: %s", p)
	}
}

type link struct {
	line   int
	target string
}

var (
	// [text](target) or [text](target "title"); text may hold code spans.
	inlineLink = regexp.MustCompile(`\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	// [label]: target
	refLink  = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?`)
	codeSpan = regexp.MustCompile("`+[^`]*`+")
	scheme   = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

// markdownLinks returns the relative link targets of a Markdown text,
// leaving out fenced code blocks, code spans, pure anchors and links with a
// scheme.
func markdownLinks(text string) []link {
	var out []link
	fenced := false
	for i, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "```") || strings.HasPrefix(trimmed, "~~~") {
			fenced = !fenced
			continue
		}
		if fenced {
			continue
		}
		// A code span may be a link's text ([`examples/ledger`](examples/ledger)),
		// so blank its content rather than dropping it.
		line = codeSpan.ReplaceAllString(line, "`code`")
		var targets []string
		for _, m := range inlineLink.FindAllStringSubmatch(line, -1) {
			targets = append(targets, m[1])
		}
		if m := refLink.FindStringSubmatch(line); m != nil {
			targets = append(targets, m[1])
		}
		for _, target := range targets {
			if strings.HasPrefix(target, "#") || scheme.MatchString(target) {
				continue
			}
			out = append(out, link{line: i + 1, target: target})
		}
	}
	return out
}

// checkLink returns what is wrong with a relative link found in a file in
// dir, or "" if it names something in the repository at root.
func checkLink(root, dir, target string) string {
	path, _, _ := strings.Cut(target, "#")
	path, _, _ = strings.Cut(path, "?")
	if path == "" {
		return "has no path"
	}
	if strings.HasPrefix(path, "/") {
		return "is absolute: use a path relative to the Markdown file"
	}
	full := filepath.Join(dir, filepath.FromSlash(path))
	rel, err := filepath.Rel(root, full)
	if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return "points outside the repository"
	}
	if _, err := os.Stat(full); err != nil {
		return "points at " + filepath.ToSlash(rel) + ", which does not exist in the repository"
	}
	return ""
}
