# Writes the R fixtures of tests/test_corpora.py (R 4.2): Rscript make_fixtures.R, run in this folder.
x <- list(
  chr = c("EMMA", NA, "caf\u00e9", iconv("na\u00efve", "UTF-8", "latin1"), ""),
  int = c(1L, NA, -7L),
  lgl = c(TRUE, FALSE, NA),
  dbl = c(1.5, NA, -2),
  seq = 1:10,
  nul = NULL,
  fac = factor(c("b", "a", "b")),
  df = data.frame(n = 1:3, s = c("x", "y", "z")),
  pl = pairlist(a = 1L, b = "two"),
  raw = as.raw(c(1, 255)),
  nested = list(list(1L), "deep")
)
saveRDS(x, "mixed_v3.rds", version = 3)
saveRDS(x, "mixed_v2.rds", version = 2, compress = "xz")
e <- new.env()
assign("lines", c("It is a truth universally acknowledged,", "", "that a single man"), e)
assign("nums", c(3L, 1L, 4L), e)
tools:::makeLazyLoadDB(e, "lazy_z", compress = TRUE)
tools:::makeLazyLoadDB(e, "lazy_xz", compress = 3)
