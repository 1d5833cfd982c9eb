// Package docs holds no code: its test checks that every relative link in
// the repository's user documentation (README.md and docs/*.md) points at a
// file or directory that exists, so the docs cannot point at files users do
// not have.
package docs
